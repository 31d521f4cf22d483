"""The shipped Prometheus rule files with the site's runbook base URL: `python -m monitoring.rule_files`.

The rules in monitoring/prometheus/rules/ carry absolute `runbook_url`s on the default base
(rlm_runbook_base_url in clusterspec/variables.yml); the prometheus role writes them through this
with the inventory's base, so the links in every notification open the site's own runbooks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clusterspec.variables import default

RULES = Path(__file__).resolve().parent / "prometheus" / "rules"
DEFAULT_BASE_URL = default("rlm_runbook_base_url")


def render(text: str, base_url: str) -> str:
    """`text` with every runbook link moved from the default base onto `base_url`."""
    return text.replace(f'"{DEFAULT_BASE_URL}#', f'"{base_url.rstrip("#")}#')


def write_rules(base_url: str, out: Path, rules: Path = RULES) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(rules.glob("*.yml")):
        target = out / path.name
        target.write_text(render(path.read_text(), base_url))
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m monitoring.rule_files", description=__doc__)
    parser.add_argument("--runbook-base-url", default=DEFAULT_BASE_URL)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.runbook_base_url.startswith(("https://", "http://")):
        print(
            f"error: --runbook-base-url {args.runbook_base_url!r} is not an absolute http(s) URL; "
            "set rlm_runbook_base_url to e.g. https://wiki.example.org/rlm-ops/runbooks",
            file=sys.stderr,
        )
        return 2
    for path in write_rules(args.runbook_base_url, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
