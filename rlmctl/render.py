"""Turn rlmctl's records (rlmctl.records, rlmctl.health) into tables for people or JSON for tools.

The only module that prints results; progress lines and bars of long commands go to stderr (`say`,
`progress`) so that `--json` keeps stdout machine-readable. Tables fit the terminal (80 columns
and up) without cutting what an operator copies: names of runs, hosts and checkpoint
directories are never wrapped or shortened, paths are shown relative to the run directory (named
once above the table), and prose (details, fixes) is folded, never cut with an ellipsis. Lines
outside tables are not broken by rlmctl: the terminal wraps them, and a copy keeps them whole.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rlmctl.records import (
    DryRun,
    LayoutChoice,
    Plan,
    RunStatus,
    RunSummary,
    StopResult,
    as_dict,
)

STATE_STYLE = {"OK": "green", "WARN": "yellow", "CRIT": "bold red", "UNKNOWN": "magenta"}


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def say() -> Callable[[str], None]:
    """Progress lines: to stderr."""
    err = console(stderr=True)
    return lambda message: err.print(message, markup=False, soft_wrap=True)


def emit_json(record: Any) -> None:
    """A record as JSON on stdout: numbers stay numbers (a non-finite one is null)."""
    data = record.as_dict() if hasattr(record, "as_dict") else as_dict(record)
    print(json.dumps(_finite(data), indent=1, default=str))


def emit_json_line(record: Any) -> None:
    """One record per line (JSON Lines) for streaming commands: logs, watch."""
    data = record.as_dict() if hasattr(record, "as_dict") else as_dict(record)
    print(json.dumps(_finite(data), default=str), flush=True)


def _finite(data: Any) -> Any:
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(value) for value in data]
    return data


def line(text: str) -> None:
    console().print(text, markup=False, soft_wrap=True)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value if value is not None else "-")


def state_name(state: Any) -> str:
    return state.value if state is not None else "unknown"


# A column whose cells are copied (names, relative paths): never wrapped or shortened; the
# other columns give way, and their prose folds.
KEEP = "keep"


def _table(columns: tuple[str, ...], keep: tuple[str, ...] = ()) -> Any:
    """A table with `columns`; those in `keep` are never wrapped or cut, the others fold."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for column in columns:
        if column in keep:
            table.add_column(column, no_wrap=True, overflow="ignore")
        else:
            table.add_column(column, overflow="fold")
    return table


MIN_FOLDED = 8  # columns that fold get at least this many characters


def _show(
    columns: tuple[str, ...], rows: Sequence[tuple[str, ...]], keep: tuple[str, ...] = ()
) -> None:
    """`rows` as a table; cells may carry rich markup. When the terminal is too narrow for the
    kept cells side by side, each row becomes its first cell on a line of its own and the other
    cells as `column: value` on the next (`kubectl describe`-like), still nothing cut."""
    from rich.cells import cell_len
    from rich.text import Text

    out = console()
    shown = [[Text.from_markup(cell).plain for cell in row] for row in rows]
    widths = [max([cell_len(c)] + [cell_len(r[i]) for r in shown]) for i, c in enumerate(columns)]
    need = sum(w if c in keep else min(w, MIN_FOLDED) for c, w in zip(columns, widths, strict=True))
    need += 3 * (len(columns) - 1)  # the gaps between columns
    if need <= out.width:
        table = _table(columns, keep)
        for row in rows:
            table.add_row(*row)
        out.print(table)
        return
    for row in rows:
        out.print(row[0], soft_wrap=True)
        rest = "   ".join(f"{c}: {cell}" for c, cell in zip(columns[1:], row[1:], strict=True))
        out.print(f"  {rest}", soft_wrap=True)


@contextlib.contextmanager
def progress(
    description: str, total: float | None, unit: str = ""
) -> Iterator[Callable[[float], None]]:
    """A progress bar on stderr while a command waits (hosts answered, bytes verified, seconds
    of a stop's grace period); `advance(n)` moves it. Nothing is drawn where stderr is not a
    terminal (rich's TTY_COMPATIBLE=1 TTY_INTERACTIVE=1 force it, as tests do)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    err = console(stderr=True)
    if not err.is_interactive:
        yield lambda _: None
        return
    count = (
        TextColumn("{task.completed:.0f}/{task.total:.0f} " + unit)
        if unit
        else MofNCompleteColumn()
    )
    columns = (TextColumn("{task.description}"), BarColumn(), count, TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda amount: bar.advance(task, amount)


# inventory / health -------------------------------------------------------------------------------
def inventory(source: str, hosts: list[Any], routes: dict[str, Any]) -> None:
    shared = {h.shared_dir for h in hosts}
    common = f"; shared dir {next(iter(shared))}" if len(shared) == 1 else ""
    line(f"{len(hosts)} host(s) from {source}{common}")
    columns = ("host", "ssh", "groups", "gpus") + (() if common else ("shared dir",))
    rows = []
    for h in hosts:
        route = routes.get(h.name)
        row = (
            h.name,
            route.describe() if route else "local",
            ",".join(h.groups),
            f"{h.gpus_per_node} {h.gpu_vendor}",
        )
        rows.append(row + (() if common else (h.shared_dir,)))
    _show(columns, rows, keep=("host", "gpus"))


def health(report: Any) -> None:
    """One row per host that needs attention (every host when the fleet is small), then the
    detail and fix of each non-OK check, one line each."""
    shown = [h for h in report.hosts if h.state != "OK" or len(report.hosts) <= 20]
    line(f"health of {len(report.hosts)} host(s): {report.state}")
    rows = []
    for host in shown:
        problems = ", ".join(f"{c.name} {c.state}" for c in host.checks if c.state != "OK")
        style = STATE_STYLE[host.state]
        rows.append((host.host, f"[{style}]{host.state}[/]", f"{host.duration:.2f} s", problems))
    columns = ("host", "state", "round trip", "not OK")
    _show(columns, rows, keep=("host", "state", "round trip"))
    hidden = len(report.hosts) - len(shown)
    if hidden:
        line(f"{hidden} more host(s) OK")
    for host in report.hosts:
        for check in host.checks:
            if check.state != "OK":
                fix = f" → {check.fix}" if check.fix else ""
                line(f"{host.host}: {check.name} {check.state}: {check.detail}{fix}")


VERDICT_STYLE = {"PASS": "green", "FAIL": "bold red", "NO DATA": "magenta", "N/A": "dim"}


def acceptance(verdict: Any) -> None:
    """The go-live table (criterion, verdict, measured, threshold), then one line per criterion
    with a note (its source with it), then the verdict and what was not checked."""
    line(f"go-live acceptance of {verdict.run}")
    rows = [
        (c.name, f"[{VERDICT_STYLE[c.verdict]}]{c.verdict}[/]", c.measured, c.threshold)
        for c in verdict.criteria
    ]
    _show(("criterion", "verdict", "measured", "threshold"), rows, keep=("verdict",))
    for c in verdict.criteria:
        if c.reason:
            line(f"{c.name} ({c.verdict}, {c.source}): {c.reason}")
    word = "ACCEPTED" if verdict.accepted else "NOT ACCEPTED"
    unchecked = f"; not checked: {', '.join(verdict.not_checked)}" if verdict.not_checked else ""
    line(f"{verdict.run}: {word}{unchecked}")
    line(f"report: {verdict.report}")


# runs ---------------------------------------------------------------------------------------------
def status(info: RunStatus) -> None:
    line(f"run {info.run}: {state_name(info.state)}")
    rows = []
    for p in info.hosts:
        alive = {True: "[green]yes[/]", False: "[red]no[/]", None: "[magenta]?[/]"}[p.alive]
        processes = str(p.processes if p.processes is not None else "-")
        rows.append((p.host, alive, processes, p.error or ""))
    _show(("host", "alive", "processes", "error"), rows, keep=("host", "alive", "processes"))
    checkpoint = info.checkpoint
    updated = time.time() - info.updated if info.updated else None
    last = (
        f"{relative(checkpoint.path, info.run_dir)} ({age(checkpoint.age_s)} old)"
        if checkpoint
        else "none"
    )
    line(
        f"step {number(info.step)}/{number(info.max_steps)}  loss {number(info.loss)}  "
        f"tokens/s {number(info.tokens_per_s)}  updated {age(updated)} ago"
    )
    line(f"last checkpoint: {last}")
    line(f"restarts: {info.restarts}   run dir: {info.run_dir}")
    from rlmctl.goodput import lines as goodput_lines

    for text in goodput_lines(info.goodput):
        line(text)
    if info.slurm:
        job = info.slurm
        reason = job.get("reason") or ""
        why = f" ({reason})" if reason and reason != "None" else ""  # squeue's pending reason
        line(
            f"slurm job {job['job_id']}: {job['state'] or 'unknown'}{why}  "
            f"nodes {job['nodes'] or '-'}"
        )
    if info.problem:
        line(f"problem: {info.problem}")


def relative(path: str, run_dir: str) -> str:
    """A path inside the run directory as the part that differs (checkpoints/step-00001000)."""
    prefix = run_dir.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else path


def runs(rows: list[RunSummary], runs_root: str) -> None:
    line(f"{len(rows)} run(s) in {runs_root}")
    cells, elsewhere = [], []
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(row.created))
        cells.append(
            (row.name, state_name(row.state), str(len(row.hosts)), str(row.restarts), created)
        )
        if row.run_dir.rstrip("/") != f"{runs_root.rstrip('/')}/{row.name}":
            elsewhere.append(f"run {row.name}: run dir {row.run_dir}")
    columns = ("run", "state", "hosts", "restarts", "created")
    _show(columns, cells, keep=("run", "state", "created"))
    for text in elsewhere:
        line(text)


def checkpoints(run: str, run_dir: str, rows: list[Any], verified: bool) -> None:
    line(
        f"{len(rows)} checkpoint(s) of {run} in {run_dir} "
        f"({'sha256' if verified else 'sizes'} checked)"
    )
    invalid = any(not row.valid for row in rows)
    columns = ("directory", "step", "valid", "size", "age") + (("problem",) if invalid else ())
    cells = []
    for row in rows:
        cell = (
            relative(row.path, run_dir),
            str(row.step),
            "[green]yes[/]" if row.valid else "[red]no[/]",
            f"{row.size_bytes / 2**20:.1f} MiB",
            age(row.age_s),
        )
        cells.append(cell + ((row.reason if not row.valid else "",) if invalid else ()))
    _show(columns, cells, keep=("directory", "step", "valid", "size", "age"))


def dry_run(planned: DryRun, as_json: bool) -> None:
    """What launch, resume or stop would run: per host the command line (a batch script is
    printed whole), then the notes; as JSON, the record."""
    if as_json:
        emit_json(planned)
        return
    say_line = say()
    say_line(f"dry run: {planned.action} {planned.run} ({planned.run_dir}); nothing was changed")
    for where, command in planned.commands.items():
        if "\n" in command:  # a batch script: printed as it would be submitted
            say_line(f"# {where}")
            print(command, end="" if command.endswith("\n") else "\n")
        else:
            print(f"{where}: {command}")
    for note in planned.notes:
        say_line(f"note: {note}")


def stopped(result: StopResult) -> None:
    if result.skipped:
        line(result.skipped)
        return
    for host in result.hosts:
        if host.ok:
            line(f"{host.host}: stopped ({host.found} process(es), {host.killed} needed SIGKILL)")
        else:
            line(f"{host.host}: FAILED: {host.error}")


def layout_choice(choice: LayoutChoice, gpus: int, gpus_per_node: int) -> str:
    sizes = ", ".join(f"{k} {v:.1f}" for k, v in choice.per_gpu_gib.items())
    verdict = (
        f"pick parallel.strategy={choice.pick}"
        if choice.pick in ("ddp", "fsdp", "hsdp")
        else "pick parallel.strategy=fsdp parallel.offload=true"
        if choice.pick
        else "none fits: more GPUs, a shorter sequence or activation checkpointing"
    )
    return f"  on {gpus} GPUs ({gpus_per_node}/node), GiB/GPU: {sizes}; {verdict}"


def plan_lines(plan: Plan) -> list[str]:
    lines = [
        f"model {plan.model}: {plan.params / 1e9:.3f} B parameters, seq {plan.seq_len}, "
        f"micro-batch {plan.micro_batch}, {plan.gpu_mem_gib:g} GiB/GPU "
        f"({plan.usable_gib:.1f} usable)",
        f"weights+grads+AdamW (16 B/param): {plan.static_gib:.1f} GiB in total",
        f"rule of thumb params×4 B / GPU memory: {plan.rule_of_thumb_gpus} GPU(s) "
        "(fp32 weights only: far too optimistic)",
    ]
    for row in plan.estimates:
        label = (
            "with activation checkpointing" if row.activation_checkpointing else "no checkpointing"
        )
        fits = "fits" if row.unsharded_fits else "does NOT fit"
        gpus = row.min_gpus_sharded
        sharded = (
            f"sharded (FSDP) needs ≥ {gpus} GPU(s), micro-batch up to "
            f"{row.max_micro_batch_at_min_gpus} there"
            if gpus
            else "sharding cannot help: activations alone exceed a GPU (lower seq len/micro-batch)"
        )
        lines.append(
            f"{label}: activations {row.activations_gib:.1f} GiB/GPU; unsharded (DDP) "
            f"{row.unsharded_per_gpu_gib:.1f} GiB/GPU {fits}; {sharded}"
        )
        lines.append(layout_choice(row.layouts, plan.gpus, plan.gpus_per_node))
    return lines


def plan(record: Plan) -> None:
    for text in plan_lines(record):
        line(text)
