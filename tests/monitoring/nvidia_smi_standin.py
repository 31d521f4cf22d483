"""A stand-in `nvidia-smi --query-gpu=... --format=csv,noheader,nounits` answering from a recording.

usage: nvidia_smi_standin.py RECORDING [--exit N] [--reject FIELD]... [--full-query FILE]
                             [--nvlink FILE] -- NVIDIA-SMI-ARGUMENTS

The fixtures (tests/monitoring/fixtures/nvidia-smi-*.csv; README.md there says where they come
from) hold the columns of RECORDED_FIELDS; `name`, `driver_version`, `uuid` and `serial` are
filled in here. A field that is not known, or is named with --reject (as an
older driver rejects `clocks_event_reasons.*`), fails the whole query the way nvidia-smi does:
'Field "X" is not a valid field to query.' and exit 2. Lines that are not GPU rows ("Unable to
determine the device handle ...") are printed as recorded. `nvidia-smi -q` and `nvidia-smi nvlink
-e` print the files given for them (exit 0), or fail as a driver without them would. Stdlib only
(it runs in rig nodes).
"""

from __future__ import annotations

import sys

RECORDED_FIELDS = (
    "index",
    "pci.bus_id",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "power.draw",
    "enforced.power.limit",
    "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.corrected.volatile.total",
    "clocks_throttle_reasons.sw_power_cap",
    "temperature.memory",
    "remapped_rows.pending",
    "remapped_rows.failure",
    "clocks_event_reasons.hw_slowdown",
    "clocks_event_reasons.hw_thermal_slowdown",
    "clocks_event_reasons.hw_power_brake_slowdown",
    "clocks_event_reasons.sw_thermal_slowdown",
)
ALIASES = {"clocks_event_reasons.sw_power_cap": "clocks_throttle_reasons.sw_power_cap"}


def filled_in(index: str) -> dict[str, str]:
    return {
        "name": "NVIDIA H100 80GB HBM3",
        "driver_version": "550.54.15",
        "uuid": f"GPU-5b0e3c1a-9f1d-4c2b-8e7a-00000000000{index}",
        "serial": f"165042301000{index}",
    }


def main(argv: list[str]) -> int:
    recording, rest = argv[0], argv[1:]
    split = rest.index("--")
    options, tool_args = rest[:split], rest[split + 1 :]
    exit_code = int(options[options.index("--exit") + 1]) if "--exit" in options else 0
    rejected = {options[i + 1] for i, o in enumerate(options) if o == "--reject"}
    for words, option in ((["-q"], "--full-query"), (["nvlink", "-e"], "--nvlink")):
        if tool_args == words:
            if option not in options:
                print(f"{' '.join(words)} is not supported by this stand-in")
                return 3
            with open(options[options.index(option) + 1]) as f:
                print(f.read(), end="")
            return 0
    query = next(a.split("=", 1)[1] for a in tool_args if a.startswith("--query-gpu="))
    fields = query.split(",")
    for field in fields:
        known = field in RECORDED_FIELDS or field in ALIASES or field in filled_in("0")
        if field in rejected or not known:
            print(f'Field "{field}" is not a valid field to query.')
            return 2
    with open(recording) as f:
        for line in f.read().splitlines():
            cells = [cell.strip() for cell in line.split(",")]
            if not cells[0].isdigit():
                print(line)
                continue
            values = dict(zip(RECORDED_FIELDS, cells, strict=True)) | filled_in(cells[0])
            print(", ".join(values[ALIASES.get(field, field)] for field in fields))
    return exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
