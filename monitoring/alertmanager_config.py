"""alertmanager.yml with the site's receivers: `python -m monitoring.alertmanager_config`.

Routing, grouping and inhibitions come from monitoring/alertmanager/alertmanager.yml; the
receivers are built from the inventory's rlm_alert_* variables (clusterspec/variables.yml), read
as JSON on stdin so that secrets (Slack URL, SMTP password, PagerDuty key) never show in a process
list; the alertmanager role passes them with no_log. Critical alerts go to `pager` (PagerDuty plus
every other integration), warnings to `team` (every integration but PagerDuty), the Watchdog to
`watchdog` (the dead-man's switch URL), info alerts nowhere.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

SHIPPED = Path(__file__).resolve().parent / "alertmanager" / "alertmanager.yml"
SETTINGS = (
    "rlm_alert_webhook_url",
    "rlm_alert_watchdog_url",
    "rlm_alert_slack_api_url",
    "rlm_alert_slack_channel",
    "rlm_alert_email_to",
    "rlm_alert_email_from",
    "rlm_alert_smtp_smarthost",
    "rlm_alert_smtp_username",
    "rlm_alert_smtp_password",
    "rlm_alert_pagerduty_routing_key",
)
# One line per alert, with its runbook: what Slack and e-mail show.
ALERT_LINES = (
    "{{ range .Alerts }}[{{ .Status }}] {{ .Annotations.summary }} {{ .Annotations.runbook_url }}\n"
    "{{ end }}"
)


class SettingsError(ValueError):
    """A receiver setting is missing its partner or is not what Alertmanager accepts."""


def integrations(settings: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Alertmanager *_configs for every integration the settings configure (PagerDuty apart)."""
    s = {key: (settings.get(key) or "") for key in SETTINGS}
    found: dict[str, list[dict[str, Any]]] = {}
    if s["rlm_alert_webhook_url"]:
        found["webhook_configs"] = [{"url": s["rlm_alert_webhook_url"], "send_resolved": True}]
    if s["rlm_alert_slack_api_url"]:
        if not s["rlm_alert_slack_channel"]:
            raise SettingsError("rlm_alert_slack_api_url is set but rlm_alert_slack_channel is not")
        found["slack_configs"] = [
            {
                "api_url": s["rlm_alert_slack_api_url"],
                "channel": s["rlm_alert_slack_channel"],
                "send_resolved": True,
                "title": "{{ .CommonLabels.alertname }} ({{ .Status }})",
                "text": ALERT_LINES,
            }
        ]
    if s["rlm_alert_email_to"]:
        missing = [k for k in ("rlm_alert_email_from", "rlm_alert_smtp_smarthost") if not s[k]]
        if missing:
            raise SettingsError(f"rlm_alert_email_to is set but {', '.join(missing)} is not")
        email: dict[str, Any] = {
            "to": s["rlm_alert_email_to"],
            "from": s["rlm_alert_email_from"],
            "smarthost": s["rlm_alert_smtp_smarthost"],
            "send_resolved": True,
            "text": ALERT_LINES,
        }
        if s["rlm_alert_smtp_username"]:
            email["auth_username"] = s["rlm_alert_smtp_username"]
            email["auth_password"] = s["rlm_alert_smtp_password"]
        found["email_configs"] = [email]
    return found


def receivers(settings: dict[str, Any]) -> list[dict[str, Any]]:
    team = integrations(settings)
    pager = dict(team)
    key = settings.get("rlm_alert_pagerduty_routing_key") or ""
    if key:
        pager["pagerduty_configs"] = [
            {
                "routing_key": key,
                "send_resolved": True,
                "description": "{{ .CommonAnnotations.summary }}",
                "links": [{"href": "{{ .CommonAnnotations.runbook_url }}", "text": "runbook"}],
            }
        ]
    watchdog: dict[str, Any] = {"name": "watchdog"}
    if settings.get("rlm_alert_watchdog_url"):
        watchdog["webhook_configs"] = [{"url": settings["rlm_alert_watchdog_url"]}]
    return [
        {"name": "pager", **pager},
        {"name": "team", **team},
        watchdog,
        {"name": "blackhole"},
    ]


def render(settings: dict[str, Any], shipped: Path = SHIPPED) -> dict[str, Any]:
    config = yaml.safe_load(shipped.read_text())
    config["receivers"] = receivers(settings)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m monitoring.alertmanager_config", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        settings = json.loads(sys.stdin.read() or "{}")
        if not isinstance(settings, dict):
            raise SettingsError("the settings on stdin are not a JSON object")
        config = render(settings)
    except (ValueError, SettingsError) as error:
        print(f"error: {error}; set the rlm_alert_* variables (docs/variables.md)", file=sys.stderr)
        return 2
    args.out.write_text(yaml.safe_dump(config, sort_keys=False))
    args.out.chmod(0o640)  # it holds secrets
    return 0


if __name__ == "__main__":
    sys.exit(main())
