"""`rlmctl slurm`: the sbatch script of a run, for sites where Slurm, not SSH, starts the job.

One srun task per node runs a small wrapper (`<run>/slurm-node.py`, written by the script) that
runs torchrun; the c10d rendezvous sits on the allocation's first node and the job id is the
rendezvous id. The wrapper pins each rank to the cores near its GPU (the node's own topology,
`clusterspec.binding`: torchrun starts `python -m clusterspec.binding pin -- python -m trainer`,
the step itself unbound with `--cpu-bind=none`) and writes the node's exit record
(`hosts/<node>/exit.json`: the attempt's exit code, when, the job id, whether Slurm had signalled
it first), from which `rlmctl watch` tells the node a job failed on from the nodes
`srun --kill-on-bad-exit` brought down after it.

Slurm's `--signal=B:TERM@120` reaches the batch shell alone, two minutes before the time limit
(a third of a limit under six minutes); it remembers that and passes SIGTERM on to the training
step, whose wrappers pass it on to the trainers (not to torchrun, which would end in a
traceback and exit 1 after a clean stop): they finish the step, save a checkpoint and exit 0.
The script then asks the run directory (`stopped_before_end`) and requeues the job only when it
had that signal, or when Slurm preempted the job (its PreemptTime is set: preemption signals
the tasks, which checkpoint the same way, and Slurm itself would requeue only a job still running
when GraceTime ends): the job then resumes from the newest checkpoint in the same run directory,
and the script records a `requeued` event with the reason first. A trainer that saved and
stopped because srun signalled it after a peer died is a failure (the job ends FAILED), for
`watch` to resubmit without the failed node.

Segments (`launch --segments N`): N jobs chained with `--dependency=afterany`, each of the
partition's time limit at most. A segment stopped by the time-limit signal ends (exit 0) and the
next one resumes from its checkpoint; a preempted segment requeues itself as above; a segment
that finds the run done exits at once, and the segment that finishes the run cancels the ones
still pending.

The site's options (`SiteOptions`: rlm_slurm_account, _qos, _reservation, _constraint,
_sbatch_options, _partition_options, and launch's flags) follow rlmctl's own #SBATCH lines.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterspec.inventory import Host
from rlmctl import container
from rlmctl.errors import RlmctlError

# Slurm's --time forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
SIGNAL_LEAD_S = 120  # the time-limit signal this long before the limit: time to checkpoint


def time_limit_seconds(text: str) -> int:
    """Slurm's --time in seconds; a form Slurm does not take is a one-line error."""
    if text.strip().upper() in ("INFINITE", "UNLIMITED"):
        return 2**31
    match = TIME_RE.match(text.strip())
    if not match:
        raise RlmctlError(
            f"--time {text!r} is not a Slurm time limit; use minutes, HH:MM:SS or D-HH:MM:SS"
        )
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if third is not None:  # HH:MM:SS
        return (int(first) * 60 + int(second)) * 60 + int(third)
    if second is not None:  # MM:SS
        return int(first) * 60 + int(second)
    return int(first) * 60  # minutes


def signal_lead_s(time_limit: str) -> int:
    """Seconds before the time limit that the batch shell gets SIGTERM: two minutes, or a third
    of a limit under six (Slurm may signal up to a minute early: a short debug job still trains
    before its signal)."""
    return min(SIGNAL_LEAD_S, time_limit_seconds(time_limit) // 3)


# sbatch options the batch script sets itself, or that would break it (their short forms too):
# refused in the site's lists, naming the variable. --error: `rlmctl logs` reads the one output.
OWN_OPTIONS = {
    "--nodes": "-N",
    "--ntasks": "-n",
    "--ntasks-per-node": None,
    "--time": "-t",
    "--partition": "-p",
    "--job-name": "-J",
    "--output": "-o",
    "--error": "-e",
    "--signal": None,
    "--requeue": None,
    "--no-requeue": None,
    "--exclusive": None,
    "--chdir": "-D",
    "--open-mode": None,
    "--gpus-per-node": None,
    "--exclude": "-x",
    "--dependency": "-d",
    "--array": "-a",
    "--wrap": None,
}
# What launch's own flags stand for instead of these options.
OWN_FLAGS = {
    "--nodes": "launch --nodes",
    "--time": "launch --time",
    "--partition": "launch --partition",
    "--job-name": "launch --name",
    "--dependency": "launch --segments",
    "--exclude": "--exclude",
}
# rlm_slurm_<key> with one value each, in the order the script carries them, and the flag.
SITE_VALUES = {
    "account": "--account",
    "qos": "--qos",
    "reservation": "--reservation",
    "constraint": "--constraint",
}
_SHORT = {short: long for long, short in OWN_OPTIONS.items() if short}


def option_name(item: str) -> str:
    """`--mail-type=END` -> --mail-type, `-N2` / `-N 2` -> --nodes: the long name sbatch reads."""
    if item.startswith("--"):
        return re.split(r"[=\s]", item, maxsplit=1)[0]
    return _SHORT.get(item[:2], item[:2])


def _options(items: Any, variable: str) -> tuple[str, ...]:
    if items is None:
        return ()
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) for i in items):
        raise RlmctlError(
            f'{variable} must be a list of sbatch options like ["--mail-type=END,FAIL"], '
            f"got {items!r}; fix it in the inventory"
        )
    for item in items:
        if not item.startswith("-") or "\n" in item or "\r" in item:
            raise RlmctlError(
                f"{variable}: {item!r} is not one sbatch option (like --comment=proj-42, on one "
                "line); fix it in the inventory"
            )
        name = option_name(item)
        if name in OWN_OPTIONS:
            instead = OWN_FLAGS.get(name)
            how = f"use {instead}" if instead else "rlmctl's batch script needs its own"
            raise RlmctlError(
                f"{variable}: {name} is set by rlmctl itself ({how}); remove {item!r} from "
                f"{variable}"
            )
    return tuple(items)


def _value(value: Any, variable: str) -> str | None:
    if value is None or value == "":
        return None
    text = str(value)
    if not isinstance(value, str | int) or re.search(r"\s", text):
        raise RlmctlError(f"{variable} must be one word, got {value!r}; fix it")
    return text


@dataclass(frozen=True)
class SiteOptions:
    """The site's sbatch options of a job: account, QOS, reservation and constraint (the
    inventory's rlm_slurm_<key>, replaced by launch's and resume's flags), the site's extra
    options for every job and per partition."""

    values: dict[str, str] = field(default_factory=dict)
    extra: tuple[str, ...] = ()
    per_partition: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, host: Host, flags: Mapping[str, str | None] | None = None) -> SiteOptions:
        """The options of `host`'s inventory with the command line's `flags` (account, qos,
        reservation, constraint) in place of the inventory's; bad input is one line naming
        the variable or flag."""
        site = host.slurm_site
        values = {}
        for key, flag in SITE_VALUES.items():
            given = (flags or {}).get(key)
            value = _value(given, flag) if given else _value(site.get(key), f"rlm_slurm_{key}")
            if value:
                values[key] = value
        per = site.get("partition_options") or {}
        if not isinstance(per, dict):
            raise RlmctlError(
                "rlm_slurm_partition_options must map a partition to its sbatch options, like "
                f'{{urgent: ["--qos=high"]}}, got {per!r}; fix it in the inventory'
            )
        return cls(
            values=values,
            extra=_options(site.get("sbatch_options"), "rlm_slurm_sbatch_options"),
            per_partition={
                str(name): _options(items, f"rlm_slurm_partition_options[{name}]")
                for name, items in per.items()
            },
        )

    def directives(self, partition: str | None) -> list[str]:
        """#SBATCH options after rlmctl's own: account, QOS, reservation, constraint, the site's
        options, then the partition's (for an option given twice sbatch keeps the last)."""
        out = [f"{SITE_VALUES[key]}={value}" for key, value in self.values.items()]
        out += self.extra
        out += self.per_partition.get(partition, ()) if partition else ()
        return out

    def as_dict(self) -> dict[str, str]:
        return dict(self.values)


def render(
    config: Path,
    name: str,
    nodes: int,
    gpus_per_node: int,
    partition: str | None,
    time_limit: str,
    host: Host,
    run_dir: str | None = None,
    exclude: list[str] | None = None,
    resume_from: str | None = None,
    site: SiteOptions | None = None,
    segment: int = 1,
    segments: int = 1,
    overrides: list[str] | None = None,
) -> str:
    """The batch script of a run's job; `segment` of `segments` for a chain (launch
    --segments). `site`: the site's options (default: the inventory's, of `host`)."""
    if run_dir is None and not config.is_file():  # a launch writes it into run_dir first
        raise RlmctlError(f"config file {config} does not exist; pass --config FILE")
    if nodes < 1 or gpus_per_node < 1:
        raise RlmctlError("--nodes and --gpus-per-node must be >= 1")
    if not 1 <= segment <= segments:
        raise RlmctlError(f"--segments {segments}: ask for at least one segment")
    site = SiteOptions.of(host) if site is None else site
    run_dir = run_dir or f"{host.runs_dir}/{name}"
    q = shlex.quote
    directives = [
        f"--job-name={name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        # Whole nodes: every core and all memory of a node belong to the run's workers.
        "--exclusive",
        f"--time={time_limit}",
        f"--output={run_dir}/slurm-%j.out",
        "--open-mode=append",  # a requeued job keeps its earlier attempts' output
        f"--chdir={host.shared_dir}",  # relative data paths mean what they mean over SSH
        f"--signal=B:TERM@{signal_lead_s(time_limit)}",
        "--requeue",
    ]
    if host.gpu_vendor != "none":  # CPU nodes have no gres/gpu; one worker per "GPU" slot
        directives.insert(3, f"--gpus-per-node={gpus_per_node}")
    if partition:
        directives.append(f"--partition={partition}")
    if exclude:
        directives.append(f"--exclude={','.join(exclude)}")
    directives += site.directives(partition)
    # A launch starts fresh and a resume from the checkpoint rlmctl verified; a requeue of that
    # job (time limit, preemption) and every later segment of a chain from the newest one since.
    resume = ""
    if segment > 1:
        resume = "RLM_RESUME=auto\n"
    elif resume_from:
        resume = (
            f'RLM_RESUME=auto\nif [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then '
            f"RLM_RESUME={q(resume_from)}; fi\n"
        )
    exports = "".join(f"export {k}={q(v)}\n" for k, v in sorted(host.comm_env.items()))
    image = host.container_image
    # In the image (pyxis), its own python3 runs the node wrapper; the batch shell's bookkeeping
    # runs the bundle's Python of the node it starts on.
    step_python = container.IMAGE_PYTHON if image else host.python
    # One task per node with every CPU of the node (an srun step otherwise gets one CPU per
    # task: its cgroup would hold the ranks to one core), unbound: the ranks pin themselves.
    srun = [
        "srun",
        "--kill-on-bad-exit=1",
        "--cpus-per-task=$SLURM_CPUS_ON_NODE",
        "--cpu-bind=none",
    ]
    if image:
        srun += container.pyxis_options(host, image)
    node = node_wrapper(name, config, gpus_per_node, host, overrides)
    python = q(host.python)
    return f"""#!/bin/bash
# Generated by rlmctl for run {name}: {nodes} node(s) × {gpus_per_node} GPU(s), segment {segment} of {segments}.
{"".join(f"#SBATCH {d}{chr(10)}" for d in directives)}
set -euo pipefail
RUN_DIR={q(run_dir)}
RLM_SEGMENT={segment} RLM_SEGMENTS={segments}
mkdir -p "$RUN_DIR"
{resume}{exports}export PYTHONUNBUFFERED=1 RUN_DIR{" RLM_RESUME" if resume else ""}
job_started=$(date +%s)
# A new attempt of the run (rlmctl recorded the first one): back from the queue, or the next
# segment of a chain, which has nothing to do once the run is done.
opening=$({python} -c 'import sys; from runcontract.rundir import RunDir
from runcontract.states import EventKind, RunState
run, job, restart, segment = RunDir(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if restart == 0 and segment > 1 and run.state() is RunState.DONE:
    print("done")
elif restart or segment > 1:
    run.record(EventKind.LAUNCHED, launch="requeue" if restart else "segment", scheduler="slurm",
               job_id=job, restart=restart, segment=segment)' \\
  "$RUN_DIR" "$SLURM_JOB_ID" "${{SLURM_RESTART_COUNT:-0}}" "$RLM_SEGMENT" || true)
if [ "$opening" = done ]; then
  echo "run {name} is done: segment $RLM_SEGMENT has nothing to do"
  exit 0
fi
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export head_node
node_script="$RUN_DIR/slurm-node.py"
cat >"$node_script.$SLURM_JOB_ID" <<'RLM_NODE_SCRIPT'
{node}RLM_NODE_SCRIPT
mv -f "$node_script.$SLURM_JOB_ID" "$node_script"

# The time-limit signal (--signal=B:TERM@N) comes to this shell alone: remember it, and pass
# it on to the training step, whose trainers then checkpoint and exit. Only a job stopped by
# this signal or by preemption requeues (or, in a chain, makes way for the next segment); a
# trainer that stopped because a peer died is a failure.
limit_signal=false
preempted=false
on_limit_signal() {{
  limit_signal=true
  scancel --signal=TERM "$SLURM_JOB_ID" || true
}}
trap on_limit_signal TERM USR1

set +e
step_status=$(mktemp)
(
  {" ".join(q(word) if "$" not in word else f'"{word}"' for word in srun)} {q(step_python)} "$node_script"
  echo $? >"$step_status"
) &
until wait; do :; done  # a trap ends `wait` early; srun's code is in the file
status=$(cat "$step_status")
rm -f "$step_status"
# Preemption (PreemptMode=REQUEUE) signals the steps' tasks, not this shell, at PreemptTime,
# and Slurm requeues only a job still running when GraceTime ends: a trainer that saved and
# stopped sooner would leave the job FAILED (seen on the rig, Slurm 22.05). Since this attempt
# started, a PreemptTime counts as the requeue signal; the requeue below is then the only one.
preempted_at=$(squeue --noheader --jobs "$SLURM_JOB_ID" --Format=PreemptTime | tr -d ' ')
if [[ "$preempted_at" == [0-9]* ]] && (( $(date -d "$preempted_at" +%s) >= job_started )); then
  preempted=true
fi
set -e
# How the trainer ended: "asked" (an operator's `rlmctl stop`, recorded before its signal),
# "requeue" (stopped on the time-limit or preemption signal after a checkpoint: back to the
# queue, to resume from it, after a `requeued` event), "next" (stopped on the time-limit signal
# in a chain that has a next segment), "done" (its last step) or "end".
outcome=$({python} -c 'import sys; from runcontract.rundir import RunDir
from runcontract.states import EventKind, RunState
run = RunDir(sys.argv[1])
started, limit, preempted = float(sys.argv[2]), sys.argv[3] == "true", sys.argv[4] == "true"
segment, segments, job, restart = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7], int(sys.argv[8])
asked = any(e.kind == EventKind.STOP_REQUESTED and e.time >= started for e in run.events())
early = (limit or preempted) and run.status().stopped_before_end
if asked:
    print("asked")
elif early and limit and not preempted and segments > 1:
    print("next" if segment < segments else "end")
elif early:
    reason = "preempted" if preempted else "time limit"
    run.append_event(EventKind.REQUEUED, job_id=job, restart=restart + 1, reason=reason,
                     seen_by="batch script")
    print("requeue")
else:
    print("done" if run.state() is RunState.DONE else "end")' \\
  "$RUN_DIR" "$job_started" "$limit_signal" "$preempted" "$RLM_SEGMENT" "$RLM_SEGMENTS" \\
  "$SLURM_JOB_ID" "${{SLURM_RESTART_COUNT:-0}}")
if [ "$outcome" = asked ]; then
  scancel "$SLURM_JOB_ID"  # the trainer has checkpointed: the job ends CANCELLED, not requeued
  exit "$status"
elif [ "$outcome" = requeue ]; then
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
elif [ "$outcome" = next ]; then
  echo "segment $RLM_SEGMENT of $RLM_SEGMENTS reached its time limit: the next one resumes"
  exit 0
elif [ "$outcome" = done ] && [ "$RLM_SEGMENTS" != 1 ]; then
  # The later segments of the chain have nothing left to do.
  scancel --state=PENDING --name={q(name)} || true
fi
exit "$status"
"""


def node_wrapper(
    name: str, config: Path, gpus_per_node: int, host: Host, overrides: list[str] | None = None
) -> str:
    """The program each node's srun task runs (see the module's docstring)."""
    torchrun = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(gpus_per_node),
        "--rdzv-backend=c10d",
        "--max-restarts=0",
    ]
    trainer = ["-m", "trainer", "train", "--config", str(config.resolve())]
    return f"""# Run {name}, one per node (srun): this node's torchrun, its ranks pinned to the cores near
# their GPUs, then its exit record in the run directory (written by the job's batch script). The
# record tells `rlmctl watch` where a job failed first; this wrapper is not the trainer's command
# line, so it outlives a killed trainer. Slurm signals the task (this process), not its
# children: SIGTERM is passed on to the trainers (torchrun's children), which save and exit 0,
# and torchrun then ends cleanly. It exits with the attempt's exit code (RunDir.end_attempt: the
# trainer's own, which torchrun does not pass on), and so do srun and the job.
import os, signal, subprocess, sys
from runcontract.rundir import RunDir

env = os.environ
node = env["SLURMD_NODENAME"]
torchrun = [sys.executable, *{torchrun!r},
            "--nnodes", env["SLURM_JOB_NUM_NODES"], "--rdzv-id", env["SLURM_JOB_ID"],
            "--rdzv-endpoint", env["head_node"] + ":{host.rdzv_port}"]
trainer = [sys.executable, *{trainer!r}, "run_dir=" + env["RUN_DIR"]]
if env.get("RLM_RESUME"):
    trainer.append("checkpoint.resume=" + env["RLM_RESUME"])
trainer += {list(overrides or [])!r}
try:
    from clusterspec.binding import RANK_CPUS_ENV, BindingError, plan_here

    plan = plan_here({gpus_per_node}, {host.gpu_vendor!r})["plan"]
    env[RANK_CPUS_ENV] = plan[RANK_CPUS_ENV]
    print(f"{{node}}: ranks pinned to CPUs {{' '.join(plan['ranks'])}}", flush=True)
    pin = [sys.executable, "-m", "clusterspec.binding", "pin", "--"]
    argv = [*torchrun, "--no-python", *pin, *trainer]
except (ImportError, BindingError, OSError) as error:
    print(f"{{node}}: ranks not pinned: {{error}}", file=sys.stderr, flush=True)
    argv = [*torchrun, *trainer[1:]]
signalled = forwarded = False
child = None


def children(pid):
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{{entry}}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        if entry.isdigit() and int(text[text.rindex(")") + 2 :].split()[1]) == pid:
            out.append(int(entry))
    return out


def forward(signum, frame):
    global signalled, forwarded
    signalled = True
    if child is None:  # torchrun is starting: passed on once it has a pid (below)
        return
    forwarded = True
    for pid in children(child.pid) or [child.pid]:  # the trainers, once torchrun started them
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


# The handler before the child: a SIGTERM in between would end this wrapper with no record.
signal.signal(signal.SIGTERM, forward)
child = subprocess.Popen(argv)
if signalled and not forwarded:
    forward(signal.SIGTERM, None)
code = child.wait()
code = 128 - code if code < 0 else code  # killed by signal n: 128 + n, as a shell says
run = RunDir(env["RUN_DIR"])
code = run.end_attempt(node, code, job_id=env["SLURM_JOB_ID"], signalled=signalled)
sys.exit(code)
"""
