"""`python -m runcontract.attempt RUN_DIR HOST LAUNCHER_CODE`: a launcher's last step.

rlmctl's launcher shell runs it with the training environment's python when its torchrun has
ended (`RunDir.end_attempt`): it writes hosts/<HOST>/exit.json with the attempt's exit code (the
trainer's own, which torchrun does not pass on) and prints that code for the shell to exit with.
"""

from __future__ import annotations

import sys

from runcontract.rundir import RunDir


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not argv[2].lstrip("-").isdigit():
        print("usage: python -m runcontract.attempt RUN_DIR HOST LAUNCHER_CODE", file=sys.stderr)
        return 2
    run_dir, host, launcher_code = argv
    print(RunDir(run_dir).end_attempt(host, int(launcher_code)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
