"""Turn rlmctl's records (rlmctl.records, rlmctl.health) into tables for people or JSON for tools.

The only module that prints results; progress lines of long commands go to stderr (`say`) so that
`--json` keeps stdout machine-readable.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from rlmctl.records import LayoutChoice, Plan, RunStatus, RunSummary, StopResult, as_dict

STATE_STYLE = {"OK": "green", "WARN": "yellow", "CRIT": "bold red", "UNKNOWN": "magenta"}


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def say() -> Callable[[str], None]:
    """Progress lines: to stderr."""
    err = console(stderr=True)
    return lambda message: err.print(message, markup=False, soft_wrap=True)


def emit_json(record: Any) -> None:
    data = record.as_dict() if hasattr(record, "as_dict") else as_dict(record)
    print(json.dumps(data, indent=1, default=str))


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


def _table(title: str, columns: tuple[str, ...]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    return table


# inventory / health -------------------------------------------------------------------------------
def inventory(source: str, hosts: list[Any]) -> None:
    columns = ("host", "address", "user", "connection", "groups", "gpus", "shared dir")
    table = _table(f"{len(hosts)} host(s) from {source}", columns)
    for h in hosts:
        table.add_row(
            h.name,
            f"{h.address}:{h.port}",
            h.user or "",
            h.connection,
            ",".join(h.groups),
            f"{h.gpus_per_node} {h.gpu_vendor}",
            h.shared_dir,
        )
    console().print(table)


def health(report: Any) -> None:
    """One row per host that needs attention (every host when the fleet is small), then the
    detail and fix of each non-OK check."""
    out = console()
    shown = [h for h in report.hosts if h.state != "OK" or len(report.hosts) <= 20]
    table = _table(
        f"health of {len(report.hosts)} host(s): {report.state}",
        ("host", "state", "round trip", "not OK"),
    )
    for host in shown:
        problems = ", ".join(f"{c.name} {c.state}" for c in host.checks if c.state != "OK")
        style = STATE_STYLE[host.state]
        table.add_row(host.host, f"[{style}]{host.state}[/]", f"{host.duration:.2f} s", problems)
    out.print(table)
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
    """The go-live table, then the verdict and what was not checked."""
    table = _table(
        f"go-live acceptance of {verdict.run}",
        ("criterion", "threshold", "measured", "verdict", "source", "note"),
    )
    for c in verdict.criteria:
        style = VERDICT_STYLE[c.verdict]
        table.add_row(
            c.name, c.threshold, c.measured, f"[{style}]{c.verdict}[/]", c.source, c.reason
        )
    console().print(table)
    word = "ACCEPTED" if verdict.accepted else "NOT ACCEPTED"
    unchecked = f"; not checked: {', '.join(verdict.not_checked)}" if verdict.not_checked else ""
    line(f"{verdict.run}: {word}{unchecked}; report {verdict.report}")


# runs ---------------------------------------------------------------------------------------------
def status(info: RunStatus) -> None:
    table = _table(
        f"run {info.run}: {state_name(info.state)}", ("host", "alive", "processes", "error")
    )
    for p in info.hosts:
        alive = {True: "[green]yes[/]", False: "[red]no[/]", None: "[magenta]?[/]"}[p.alive]
        processes = str(p.processes if p.processes is not None else "-")
        table.add_row(p.host, alive, processes, p.error or "")
    console().print(table)
    checkpoint = info.checkpoint
    updated = time.time() - info.updated if info.updated else None
    last = f"{checkpoint.path} ({age(checkpoint.age_s)} old)" if checkpoint else "none"
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
        line(f"slurm job {job['job_id']}: {job['state'] or 'unknown'}  nodes {job['nodes'] or '-'}")
    if info.problem:
        line(f"problem: {info.problem}")


def runs(rows: list[RunSummary]) -> None:
    table = _table(
        f"{len(rows)} run(s)", ("run", "state", "hosts", "restarts", "created", "run dir")
    )
    for row in rows:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(row.created))
        table.add_row(
            row.name,
            state_name(row.state),
            str(len(row.hosts)),
            str(row.restarts),
            created,
            row.run_dir,
        )
    console().print(table)


def checkpoints(run: str, rows: list[Any], verified: bool) -> None:
    table = _table(
        f"{len(rows)} checkpoint(s) of {run} ({'sha256' if verified else 'sizes'} checked)",
        ("step", "valid", "size", "age", "path / reason"),
    )
    for row in rows:
        table.add_row(
            str(row.step),
            "[green]yes[/]" if row.valid else "[red]no[/]",
            f"{row.size_bytes / 2**20:.1f} MiB",
            age(row.age_s),
            row.path if row.valid else row.reason,
        )
    console().print(table)


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
