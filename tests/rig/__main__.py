"""`python -m tests.rig up N | down | status` (instance chosen by RLM_RIG_ID, default 0)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import NoReturn

from runcontract.rundir import read_json
from tests.rig.errors import RigError
from tests.rig.image import SUITES
from tests.rig.layout import MAX_HOSTS, MAX_SLOTS, Layout, rig_id_from_env, slot_layouts
from tests.rig.processes import ProcessId, is_running
from tests.rig.rig import Rig, check_count, require_root, teardown, teardown_all


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, like every other user error of the project (argparse would add the usage).
        self.exit(2, f"error: {message}; see `python -m tests.rig --help`\n")


def _count(text: str) -> int:
    try:
        return check_count(int(text))
    except ValueError:
        message = f"host count must be an integer 1..{MAX_HOSTS}, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    except RigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _slot(text: str) -> int:
    if not text.isdigit() or int(text) >= MAX_SLOTS:
        raise argparse.ArgumentTypeError(f"slot must be 0..{MAX_SLOTS - 1}, got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m tests.rig", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    up = commands.add_parser("up", help="bring up N hosts node1..nodeN (replacing this id's rig)")
    up.add_argument("count", type=_count, metavar="N", help=f"number of hosts, 1..{MAX_HOSTS}")
    up.add_argument("--slot", type=_slot, default=0, help="one of several rigs of this id (0)")
    up.add_argument(
        "--release",
        choices=SUITES,
        help="boot systemd nodes of this Debian release (default: the fast kind, no init)",
    )
    down = commands.add_parser("down", help="tear down the rigs of this RLM_RIG_ID")
    down.add_argument("--slot", type=_slot, help="only this one (default: every slot)")
    commands.add_parser("status", help="show the rigs of this RLM_RIG_ID")
    return parser


def _up(count: int, slot: int, release: str | None) -> None:
    rig = Rig(count, slot=slot, release=release)
    rig.up()  # tears itself down if interrupted
    kind = f"{release} systemd " if release else ""
    lines = [f"rig {rig.layout.prefix}: {count} {kind}hosts up in {rig.bring_up_s:.1f}s"]
    lines += [f"  {h.name:<8} {h.ip:<15} netns {h.netns}" for h in rig.hosts]
    lines += [
        f"inventory  {rig.inventory_path}",
        f"shared dir {rig.shared_dir}",
        f"ssh        ssh -F {rig.ssh_config_path} node1",
        f"stop with  python -m tests.rig down{f' --slot {slot}' if slot else ''}",
    ]
    # One write: a reader that stops early (`| head -1`) gets no chance to break the pipe.
    sys.stdout.write("\n".join(lines) + "\n")


def _status(rig_id: int) -> int:
    found = 0
    for layout in slot_layouts(rig_id):
        state = read_json(layout.state_file)
        if not state:
            continue
        found += 1
        age = time.time() - float(state.get("created", time.time()))
        print(f"rig {layout.prefix}: {state['count']} hosts, up {age:.0f}s, {layout.state_dir}")
        for entry in state.get("hosts", []):
            sshd = entry.get("sshd")
            if entry.get("release"):  # sshd is a unit of the node: report the node itself
                sshd = entry["holder"]
            running = bool(sshd) and is_running(ProcessId.from_json(sshd))
            print(
                f"  {entry['name']:<8} {entry['ip']:<15} sshd {'running' if running else 'stopped'}"
            )
    if not found:
        print(f"no rig is up for RLM_RIG_ID={rig_id}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        rig_id = rig_id_from_env()
        if args.command == "status":
            return _status(rig_id)
        require_root()
        if args.command == "up":
            _up(args.count, args.slot, args.release)
        elif args.slot is None:
            teardown_all(rig_id)
            print(f"rig id {rig_id}: nothing of it remains")
        else:
            teardown(Layout(rig_id, args.slot))
            print(f"rig {Layout(rig_id, args.slot).prefix}: nothing of it remains")
    except RigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; the rig was torn down", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
