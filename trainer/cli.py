"""`rlm-train` / `python -m trainer`: prepare data, train, list checkpoints, export, import-hf,
generate.

Heavy imports (torch) happen inside the commands that need them: `checkpoints` stays torch-free so
that it answers in a fraction of a second on a login node.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from trainer.errors import UserError
from trainer.rundir import RunDir

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Trainer for depth-recurrent language models (docs/trainer.md).",
)


@app.command()
def prepare(
    out: Annotated[Path, typer.Option(help="Directory to write the prepared dataset to.")],
    inputs: Annotated[
        list[Path] | None,
        typer.Argument(help=".txt/.jsonl files or directories; none: the embedded corpus."),
    ] = None,
    seq_len: Annotated[int, typer.Option(help="Tokens per training sample.")] = 128,
    vocab_size: Annotated[int, typer.Option(help="BPE vocabulary size to train.")] = 4096,
    tokenizer: Annotated[
        Path | None, typer.Option(help="Reuse this tokenizer.json instead of training one.")
    ] = None,
    min_freq: Annotated[int, typer.Option(help="Merge only pairs seen this often.")] = 2,
    shard_bytes: Annotated[int, typer.Option(help="Uncompressed bytes per shard.")] = 64 << 20,
    zstd: Annotated[bool, typer.Option(help="Compress shards with zstd.")] = False,
    check: Annotated[
        bool,
        typer.Option(help="Only verify --out: every shard's size and sha256, the tokenizer's."),
    ] = False,
) -> None:
    """Turn raw text into tokenized, packed shards (see docs/data.md)."""
    from trainer.data import check_dataset
    from trainer.data import prepare as prepare_data

    if check:
        report = check_dataset(out)
        shards = ", ".join(f"{split} {count}" for split, count in report["splits"].items())
        typer.echo(
            f"{out}: every shard matches its size and sha256 ({shards} shard(s), "
            f"{report['bytes'] / 2**20:.1f} MiB read); tokenizer ok"
        )
        return

    metadata = prepare_data(
        out,
        inputs or (),
        seq_len=seq_len,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        min_freq=min_freq,
        shard_bytes=shard_bytes,
        zstd=zstd,
    )
    splits = ", ".join(f"{name} {s['samples']}" for name, s in metadata["splits"].items())
    typer.echo(
        f"prepared {out}: vocab {metadata['vocab_size']}, seq_len {metadata['seq_len']}, "
        f"samples: {splits}"
    )


@app.command(context_settings={"ignore_unknown_options": True})
def train(
    config: Annotated[Path, typer.Option("--config", "-c", help="YAML config file.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="key=value overrides, e.g. train.steps=20")
    ] = None,
) -> None:
    """Train (single process, or one worker of torchrun)."""
    from trainer.stop_signals import StopSignals

    # Before torch loads (seconds): torchrun SIGTERMs every rank once one fails, and a rank that
    # is told to stop while it imports must still reach (and record) the same refusal.
    signals = StopSignals()
    signals.install()
    from trainer.config import load_config

    try:
        cfg = load_config(config, overrides or [])  # torch-free: a typo answers at once
        from trainer.train import train as run_training

        raise typer.Exit(int(run_training(cfg, signals=signals)))
    finally:
        signals.restore()


@app.command()
def checkpoints(
    run_dir: Annotated[Path, typer.Argument(help="Run directory.")],
    verify: Annotated[
        str, typer.Option(help="size: compare file sizes; full: also sha256 digests.")
    ] = "size",
) -> None:
    """List a run's checkpoints with their verification result."""
    if verify not in ("size", "full"):
        raise UserError(f"--verify must be size or full, got {verify!r}")
    run = RunDir(run_dir)
    if not run.path.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    infos = run.checkpoints(full=verify == "full")
    if not infos:
        typer.echo(f"no checkpoints in {run.checkpoints_dir}")
        return
    typer.echo(f"{'step':>10}  {'valid':5}  {'size':>10}  {'age':>8}  status")
    for info in infos:
        age = _age(info.age_seconds)
        size = f"{info.size_bytes / 1e6:.1f} MB" if info.valid else "-"
        status = "ok" if info.valid else info.reason
        typer.echo(
            f"{info.step:>10}  {'yes' if info.valid else 'NO':5}  {size:>10}  {age:>8}  {status}"
        )
    if not any(info.valid for info in infos):
        raise typer.Exit(1)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint directory (step-XXXXXXXX).")],
    out: Annotated[Path, typer.Argument(help="New directory for safetensors + config.")],
) -> None:
    """Export a checkpoint in the Hugging Face layout that transformers and the published code
    load (config.json, safetensors, modelling code, tokenizer)."""
    from trainer.export import export_checkpoint

    notes: list[str] = []
    path = export_checkpoint(checkpoint, out, notes=notes)
    for note in notes:
        typer.echo(f"note: {note}", err=True)
    typer.echo(f"exported to {path}")


@app.command("import-hf")
def import_hf(
    hf_dir: Annotated[Path, typer.Argument(help="Directory in the published Huginn HF layout.")],
    run_dir: Annotated[Path, typer.Argument(help="Run directory to create the checkpoint in.")],
    checkpoint_format: Annotated[
        str,
        typer.Option(
            "--format", help="full (model.pt) or sharded (DCP, checkpoint.format=sharded)."
        ),
    ] = "full",
) -> None:
    """Import published weights as a step-0 checkpoint that `train` and `generate` use."""
    from trainer.export import import_hf as import_weights

    notes: list[str] = []
    path = import_weights(hf_dir, run_dir, checkpoint_format, notes)
    for note in notes:
        typer.echo(f"note: {note}", err=True)
    typer.echo(f"imported {hf_dir} as {path}; continue with `train ... run_dir={run_dir}`")


@app.command()
def generate(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint or export directory.")],
    prompt: Annotated[str, typer.Option(help="Text to continue.")],
    depth: Annotated[int, typer.Option(help="Recurrence depth r (the most, with an exit).")] = 32,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.")] = 32,
    exit_threshold: Annotated[
        float | None,
        typer.Option(help="Stop a token's iterations once the latent state changes by < EPS."),
    ] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="tokenizer.json to use.")] = None,
) -> None:
    """Continue a prompt at a chosen recurrence depth (KV-cached; adaptive with an exit)."""
    from trainer.generate import generate_text

    result = generate_text(
        checkpoint, prompt, depth, max_new_tokens, tokenizer, exit_threshold=exit_threshold
    )
    typer.echo(result.text)
    typer.echo(
        f"mean depth {result.mean_depth:.2f} of at most {depth} over {len(result.tokens)} tokens",
        err=True,
    )


@app.command()
def evaluate(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint or export directory.")],
    depths: Annotated[str, typer.Option(help="Comma-separated recurrence depths.")] = (
        "1,4,8,16,32,64"
    ),
    data: Annotated[
        Path | None, typer.Option(help="Prepared dataset; default: the run's data.path.")
    ] = None,
    split: Annotated[str, typer.Option(help="Split to evaluate.")] = "val",
    batches: Annotated[int, typer.Option(help="Batches of --batch-size samples.")] = 2,
    batch_size: Annotated[int, typer.Option(help="Samples per batch.")] = 8,
    json_output: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of perplexity vs depth.")] = None,
) -> None:
    """Validation perplexity at several recurrence depths (test-time compute), with a plot."""
    import json

    from trainer.evaluate import evaluate_checkpoint

    try:
        wanted = [int(d) for d in depths.split(",")]
    except ValueError:
        raise UserError(f"--depths must be comma-separated integers, got {depths!r}") from None
    report = evaluate_checkpoint(checkpoint, data, wanted, split, batches, batch_size, plot=plot)
    if json_output:
        typer.echo(json.dumps(report, indent=2))
        return
    for depth, values in report["depths"].items():
        typer.echo(
            f"depth {depth:>3}: loss {values['loss']:.4f}  perplexity {values['perplexity']:.2f}"
        )
    if plot is not None:
        typer.echo(f"plot: {report['plot']}")


def main() -> None:
    """Entry point: user errors become one `error: ...` line and their exit code."""
    try:
        app(prog_name="rlm-train")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(int(exc.exit_code))
