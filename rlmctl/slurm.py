"""`rlmctl slurm`: an sbatch script for sites where Slurm, not SSH, starts the job.

One srun task per node runs a small wrapper (`<run>/slurm-node.py`, written by the script) that
runs torchrun; the c10d rendezvous sits on the allocation's first node and the job id is the
rendezvous id. The wrapper writes the node's exit record (`hosts/<node>/exit.json`: torchrun's
exit code, when, the job id, whether Slurm had signalled it first), from which `rlmctl watch`
tells the node a job failed on from the nodes `srun --kill-on-bad-exit` brought down after it.

Slurm's `--signal=B:TERM@120` reaches the batch shell alone, two minutes before the time limit
(a third of a limit under six minutes);
it remembers that and passes SIGTERM on to the training step, whose trainers finish the step,
save a checkpoint and exit. torchrun's exit code cannot tell that from a crash, so the script
asks the run directory (`stopped_before_end`) and requeues the job only when it had that
signal, or when Slurm preempted the job (its PreemptTime is set: preemption signals the tasks,
which checkpoint the same way, and Slurm itself would requeue only a job still running when
GraceTime ends): the job then resumes from the newest checkpoint in the same run directory. A trainer
that saved and stopped because srun signalled it after a peer died is a failure (the job ends
FAILED), for `watch` to resubmit without the failed node.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from clusterspec.inventory import Host
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
    overrides: list[str] | None = None,
) -> str:
    if run_dir is None and not config.is_file():  # a launch writes it into run_dir first
        raise RlmctlError(f"config file {config} does not exist; pass --config FILE")
    if nodes < 1 or gpus_per_node < 1:
        raise RlmctlError("--nodes and --gpus-per-node must be >= 1")
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
    # A resume starts from the checkpoint rlmctl verified; a requeue of that job (time limit,
    # preemption) from the newest one since, like any requeue.
    resume = ""
    if resume_from:
        resume = (
            f'RLM_RESUME=auto\nif [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then '
            f"RLM_RESUME={q(resume_from)}; fi\n"
        )
    exports = "".join(f"export {k}={q(v)}\n" for k, v in sorted(host.comm_env.items()))
    torchrun = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(gpus_per_node),
        "--rdzv-backend=c10d",
        "--max-restarts=0",
        "-m",
        "trainer",
        "train",
        "--config",
        str(config.resolve()),
    ]
    node = f"""# Run {name}, one per node (srun): this node's torchrun, then its exit record in the run
# directory (written by the job's batch script). The record tells `rlmctl watch` where a job
# failed first; this wrapper is not the trainer's command line, so it outlives a killed trainer.
# Slurm signals the task (this process), not its children: SIGTERM is passed on to torchrun,
# which passes it on to its workers. It exits with the attempt's exit code (RunDir.end_attempt:
# the trainer's own, which torchrun does not pass on), and so does srun, and the job.
import os, signal, subprocess, sys
from runcontract.rundir import RunDir

env = os.environ
argv = [sys.executable, *{torchrun!r}]
argv[3:3] = ["--nnodes", env["SLURM_JOB_NUM_NODES"], "--rdzv-id", env["SLURM_JOB_ID"],
             "--rdzv-endpoint", env["head_node"] + ":{host.rdzv_port}"]
argv.append("run_dir=" + env["RUN_DIR"])
if env.get("RLM_RESUME"):
    argv.append("checkpoint.resume=" + env["RLM_RESUME"])
argv += {list(overrides or [])!r}
signalled = False
child = subprocess.Popen(argv)


def forward(signum, frame):
    global signalled
    signalled = True
    child.send_signal(signum)


signal.signal(signal.SIGTERM, forward)
code = child.wait()
code = 128 - code if code < 0 else code  # killed by signal n: 128 + n, as a shell says
run = RunDir(env["RUN_DIR"])
code = run.end_attempt(
    env["SLURMD_NODENAME"], code, job_id=env["SLURM_JOB_ID"], signalled=signalled
)
sys.exit(code)
"""
    return f"""#!/bin/bash
# Generated by `rlmctl slurm` for run {name}: {nodes} node(s) × {gpus_per_node} GPU(s).
{"".join(f"#SBATCH {d}{chr(10)}" for d in directives)}
set -euo pipefail
RUN_DIR={q(run_dir)}
mkdir -p "$RUN_DIR"
{resume}{exports}export PYTHONUNBUFFERED=1 RUN_DIR{" RLM_RESUME" if resume_from else ""}
job_started=$(date +%s)
if [ "${{SLURM_RESTART_COUNT:-0}}" != 0 ]; then
  # Back from the queue: a new attempt of the run (rlmctl recorded the first one).
  {q(host.python)} -c 'import sys; from runcontract.rundir import RunDir
from runcontract.states import EventKind
RunDir(sys.argv[1]).record(EventKind.LAUNCHED, launch="requeue", scheduler="slurm",
                           job_id=sys.argv[2], restart=int(sys.argv[3]))' \
    "$RUN_DIR" "$SLURM_JOB_ID" "$SLURM_RESTART_COUNT" || true
fi
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export head_node
node_script="$RUN_DIR/slurm-node.py"
cat >"$node_script.$SLURM_JOB_ID" <<'RLM_NODE_SCRIPT'
{node}RLM_NODE_SCRIPT
mv -f "$node_script.$SLURM_JOB_ID" "$node_script"

# The time-limit signal (--signal=B:TERM@N) comes to this shell alone: remember it, and pass
# it on to the training step, whose trainers then checkpoint and exit. Only a job stopped by
# this signal or by preemption requeues; a trainer that stopped because a peer died is a
# failure.
limit_signal=false
on_limit_signal() {{
  limit_signal=true
  scancel --signal=TERM "$SLURM_JOB_ID" || true
}}
trap on_limit_signal TERM USR1

set +e
step_status=$(mktemp)
(
  srun --kill-on-bad-exit=1 {q(host.python)} "$node_script"
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
  limit_signal=true
fi
set -e
# How the trainer ended: "asked" (an operator's `rlmctl stop`, recorded before its signal),
# "requeue" (stopped on the time-limit or preemption signal after a checkpoint: back to the
# queue, to resume from it) or "end".
outcome=$({q(host.python)} -c 'import sys; from runcontract.rundir import RunDir
from runcontract.states import EventKind
run = RunDir(sys.argv[1])
asked = any(e.kind == EventKind.STOP_REQUESTED and e.time >= float(sys.argv[2]) for e in run.events())
early = sys.argv[3] == "true" and run.status().stopped_before_end
print("asked" if asked else "requeue" if early else "end")' "$RUN_DIR" "$job_started" "$limit_signal")
if [ "$outcome" = asked ]; then
  scancel "$SLURM_JOB_ID"  # the trainer has checkpointed: the job ends CANCELLED, not requeued
  exit "$status"
elif [ "$outcome" = requeue ]; then
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
"""
