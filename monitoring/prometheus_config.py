"""prometheus.yml as installed: `python -m monitoring.prometheus_config`.

The shipped monitoring/prometheus/prometheus.yml holds the jobs and rules; this adds what the
site decides: where Prometheus and Alertmanager listen (the `prometheus` and `alertmanager`
scrape jobs and the alerting target) and, when their web configuration turns on TLS or basic
auth (roles/monitoring_web), how Prometheus reaches them: scheme https, the CA and the name the
certificate must carry, the user and a password *file* (so prometheus.yml itself holds no
secret and stays world-readable).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

SHIPPED = Path(__file__).resolve().parent / "prometheus" / "prometheus.yml"
# The scrape jobs of the monitoring stack itself, served with its web configuration.
SELF_JOBS = ("prometheus", "alertmanager")


def client(
    *,
    https: bool,
    ca_file: str | None = None,
    server_name: str | None = None,
    username: str | None = None,
    password_file: str | None = None,
) -> dict[str, Any]:
    """The HTTP client settings of a scrape job or an alertmanagers entry."""
    out: dict[str, Any] = {}
    if https:
        out["scheme"] = "https"
        tls = {"ca_file": ca_file, "server_name": server_name}
        out["tls_config"] = {k: v for k, v in tls.items() if v}
    if username:
        if not password_file:
            raise ValueError("a basic auth username needs its password file")
        out["basic_auth"] = {"username": username, "password_file": password_file}
    return out


def render(
    prometheus: str,
    alertmanager: str,
    http: dict[str, Any] | None = None,
    shipped: Path = SHIPPED,
) -> dict[str, Any]:
    """The shipped configuration with the stack's own targets at `prometheus` and
    `alertmanager` (host:port), reached with the client settings `http`."""
    config = yaml.safe_load(shipped.read_text())
    targets = {"prometheus": prometheus, "alertmanager": alertmanager}
    http = http or {}
    for job in config["scrape_configs"]:
        if job["job_name"] in SELF_JOBS:
            job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
            job.update(http)
    config["alerting"]["alertmanagers"] = [
        {**http, "static_configs": [{"targets": [alertmanager]}]}
    ]
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m monitoring.prometheus_config", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prometheus", default="localhost:9090", help="host:port")
    parser.add_argument("--alertmanager", default="localhost:9093", help="host:port")
    parser.add_argument("--https", action="store_true", help="the stack serves TLS")
    parser.add_argument("--ca-file", help="CA bundle on the Prometheus host")
    parser.add_argument("--server-name", help="name the certificate must carry")
    parser.add_argument("--username", help="basic auth user")
    parser.add_argument("--password-file", help="basic auth password file on the Prometheus host")
    args = parser.parse_args(argv)
    try:
        http = client(
            https=args.https,
            ca_file=args.ca_file,
            server_name=args.server_name,
            username=args.username,
            password_file=args.password_file,
        )
    except ValueError as error:
        print(f"error: {error}; set rlm_monitoring_password (docs/variables.md)", file=sys.stderr)
        return 2
    config = render(args.prometheus, args.alertmanager, http)
    args.out.write_text(yaml.safe_dump(config, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
