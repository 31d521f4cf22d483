"""TLS and basic auth on Prometheus and Alertmanager, with the real daemons and every client.

The monitoring_web role runs for real (local connection) with a CA and a server certificate
made here and a bcrypt hash of a password made here; prometheus.yml is rendered by the module
the prometheus role calls, with the arguments the role passes. Then the real Prometheus and
Alertmanager serve with the role's web configuration, and the test checks what an operator
relies on: no login -> 401, a wrong CA -> the TLS handshake fails, the right ones -> 200;
Prometheus scrapes itself and Alertmanager and delivers an alert over TLS with its login;
rlmctl accept's Prometheus client queries with the inventory's CA and login.
"""

from __future__ import annotations

import base64
import datetime
import json
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from monitoring import alertmanager_config
from rlmctl import accept, inventory
from tests.ansible.playbook_run import run_playbook, write_inventory
from tests.monitoring.conftest import wait_for
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVER_NAME = "mgmt1.rlm.test"  # the name the certificate carries (and localhost, for rlmctl)
USER, PASSWORD = "rlm-monitor", "s3cret-for-the-test"

pytestmark = pytest.mark.skipif(
    not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")),
    reason="needs Debian's prometheus and prometheus-alertmanager packages",
)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(
    directory: Path, name: str
) -> tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = directory / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key, cert


def make_server_cert(directory: Path, ca_key, ca_cert) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(SERVER_NAME))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME), x509.DNSName("localhost")]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / "server.pem", directory / "server-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def get(url: str, ca: Path | None, login: tuple[str, str] | None = None) -> tuple[int, str]:
    """(status, body) of a GET, verifying HTTPS with `ca`, logging in with `login`."""
    request = urllib.request.Request(url)
    if login:
        token = base64.b64encode(f"{login[0]}:{login[1]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@dataclass
class Stack:
    prometheus: str  # https://localhost:PORT
    alertmanager: str
    ca: Path
    wrong_ca: Path
    web_dir: Path
    prometheus_yml: Path
    role_output: str


def run_monitoring_web(tmp: Path, host_vars: dict, grafana: dict | None = None) -> tuple[str, Path]:
    """The monitoring_web role for real on this machine; its whole output and its directory.
    With `grafana` (the grafana role's variables), a Grafana play follows, as in monitoring.yml."""
    plays = [{"name": "Web", "hosts": "mgmt", "gather_facts": False, "roles": ["monitoring_web"]}]
    if grafana is not None:
        plays.append(
            {"name": "Grafana", "hosts": "mgmt", "gather_facts": False, "roles": ["grafana"]}
        )
        host_vars = {**host_vars, **grafana}
    playbook = tmp / "web.yml"
    playbook.write_text(yaml.safe_dump(plays))
    web_dir = tmp / "web"
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {
        "all": {
            "children": {
                "mgmt": {
                    "hosts": {
                        "mgmt1": {
                            **local,
                            **host_vars,
                            "monitoring_web_dir": str(web_dir),
                            "monitoring_web_group": "root",
                        }
                    }
                }
            }
        }
    }
    result = run_playbook(playbook, write_inventory(tmp / "hosts.yml", inventory), tmp)
    assert result.rc == 0 and not result.failures("mgmt1"), (
        result.failures("mgmt1"),
        result.stderr,
    )
    return json.dumps(result.report) + result.stderr, web_dir


def start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def start_prometheus(config: Path, tmp: Path, port: int, web_config: str) -> subprocess.Popen:
    """The real Prometheus on loopback with a web configuration; its data and log under `tmp`."""
    argv = [
        shutil.which("prometheus"), f"--config.file={config}",
        f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
        f"--web.config.file={web_config}",
    ]  # fmt: skip
    return start(argv, tmp / "prometheus.log")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("web-tls")
    ca, ca_key, ca_cert = make_ca(tmp, "site-ca")
    wrong_ca, _, _ = make_ca(tmp, "other-ca")
    cert, key = make_server_cert(tmp, ca_key, ca_cert)
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    output, web_dir = run_monitoring_web(
        tmp,
        {
            "rlm_monitoring_tls_cert": str(cert),
            "rlm_monitoring_tls_key": str(key),
            "rlm_monitoring_tls_ca": str(ca),
            "rlm_monitoring_tls_server_name": SERVER_NAME,
            "rlm_monitoring_basic_auth_users": {USER: hashed},
            "rlm_monitoring_username": USER,
            "rlm_monitoring_password": PASSWORD,
        },
    )
    prometheus_port, alertmanager_port = free_port(), free_port()
    # What roles/prometheus renders (its "Render the Prometheus configuration" task's argv).
    config_dir = tmp / "prometheus"
    (config_dir / "rules").mkdir(parents=True)
    prometheus_yml = config_dir / "prometheus.yml"
    subprocess.run(
        [
            sys.executable, "-m", "monitoring.prometheus_config", "--out", str(prometheus_yml),
            "--prometheus", f"localhost:{prometheus_port}",
            "--alertmanager", f"localhost:{alertmanager_port}",
            "--https", "--server-name", SERVER_NAME, "--ca-file", str(web_dir / "ca.pem"),
            "--username", USER, "--password-file", str(web_dir / "password"),
        ],
        cwd=ROOT, check=True,
    )  # fmt: skip
    # Test speed only: evaluate and scrape every second; one alert that always fires.
    config = yaml.safe_load(prometheus_yml.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    prometheus_yml.write_text(yaml.safe_dump(config))
    (config_dir / "rules" / "tls.yml").write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "tls",
                        "rules": [
                            {
                                "alert": "AlertOverTLS",
                                "expr": "vector(1)",
                                "labels": {"severity": "warning"},
                            }
                        ],
                    }
                ]
            }
        )
    )
    am_yml = tmp / "alertmanager.yml"
    am_yml.write_text(yaml.safe_dump(alertmanager_config.render({})))
    web_config = str(web_dir / "web-config.yml")
    alertmanager = start(
        [
            shutil.which("prometheus-alertmanager"), f"--config.file={am_yml}",
            f"--storage.path={tmp / 'am-data'}", f"--web.listen-address=127.0.0.1:{alertmanager_port}",
            f"--web.config.file={web_config}", "--cluster.listen-address=",
        ],
        tmp / "alertmanager.log",
    )  # fmt: skip
    prometheus = start_prometheus(prometheus_yml, tmp, prometheus_port, web_config)
    stack = Stack(
        f"https://localhost:{prometheus_port}", f"https://localhost:{alertmanager_port}",
        ca, wrong_ca, web_dir, prometheus_yml, output,
    )  # fmt: skip
    try:
        for base in (stack.prometheus, stack.alertmanager):
            wait_for(
                lambda base=base: get(f"{base}/-/ready", ca, (USER, PASSWORD))[0] == 200,
                60,
                f"{base} ready",
            )
        yield stack
    finally:
        for process in (prometheus, alertmanager):
            process.terminate()
            process.wait(timeout=30)


def test_the_role_writes_the_web_configuration_with_no_secret_in_its_output(
    stack: Stack,
) -> None:
    web = yaml.safe_load((stack.web_dir / "web-config.yml").read_text())
    assert web["tls_server_config"] == {
        "cert_file": str(stack.web_dir / "cert.pem"),
        "key_file": str(stack.web_dir / "key.pem"),
    }
    assert list(web["basic_auth_users"]) == [USER]
    assert bcrypt.checkpw(PASSWORD.encode(), web["basic_auth_users"][USER].encode())
    assert (stack.web_dir / "password").read_text() == PASSWORD
    for secret in ("key.pem", "password", "web-config.yml"):
        assert (stack.web_dir / secret).stat().st_mode & 0o007 == 0, secret
    key_text = (stack.web_dir / "key.pem").read_text().splitlines()[1]
    for secret in (PASSWORD, web["basic_auth_users"][USER], key_text):
        assert secret not in stack.role_output
    promtool = subprocess.run(
        ["promtool", "check", "web-config", str(stack.web_dir / "web-config.yml")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert promtool.returncode == 0 and "SUCCESS" in promtool.stderr, promtool
    check = subprocess.run(
        ["promtool", "check", "config", str(stack.prometheus_yml)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("service", ["prometheus", "alertmanager"])
def test_no_login_is_401_a_wrong_ca_fails_tls_the_right_ones_200(
    stack: Stack, service: str
) -> None:
    base = getattr(stack, service)
    assert get(f"{base}/-/ready", stack.ca)[0] == 401
    assert get(f"{base}/-/ready", stack.ca, (USER, "wrong"))[0] == 401
    with pytest.raises(urllib.error.URLError) as refused:
        get(f"{base}/-/ready", stack.wrong_ca, (USER, PASSWORD))
    assert isinstance(refused.value.reason, ssl.SSLCertVerificationError)
    plain = base.replace("https://", "http://")
    with pytest.raises(urllib.error.HTTPError) as not_tls:
        urllib.request.urlopen(f"{plain}/-/ready", timeout=5)
    assert not_tls.value.code == 400  # "Client sent an HTTP request to an HTTPS server."
    assert get(f"{base}/-/ready", stack.ca, (USER, PASSWORD))[0] == 200


def test_prometheus_scrapes_itself_and_alertmanager_and_alerts_arrive_over_tls(
    stack: Stack,
) -> None:
    login = (USER, PASSWORD)

    def up() -> dict[str, str]:
        body = json.loads(get(f"{stack.prometheus}/api/v1/query?query=up", stack.ca, login)[1])
        return {r["metric"]["job"]: r["value"][1] for r in body["data"]["result"]}

    wait_for(
        lambda: up().get("prometheus") == "1" and up().get("alertmanager") == "1",
        60,
        lambda: f"both self-scrapes up over TLS, got {up()}",
    )

    def alerts() -> list[str]:
        body = get(f"{stack.alertmanager}/api/v2/alerts", stack.ca, login)[1]
        return [a["labels"]["alertname"] for a in json.loads(body)]

    wait_for(lambda: "AlertOverTLS" in alerts(), 60, lambda: f"the alert in {alerts()}")


def test_rlmctl_accept_queries_prometheus_with_the_inventory_ca_and_login(
    stack: Stack, tmp_path: Path
) -> None:
    shutil.copy(stack.ca, tmp_path / "site-ca.pem")
    hosts = tmp_path / "hosts.yml"
    hosts.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "children": {"compute": {"hosts": {"gpu1": {"ansible_host": "10.0.0.1"}}}},
                    "vars": {
                        "rlm_prometheus_url": stack.prometheus,
                        "rlm_monitoring_tls_ca": "site-ca.pem",  # relative to the inventory
                        "rlm_monitoring_username": USER,
                        "rlm_monitoring_password": PASSWORD,
                    },
                }
            }
        )
    )
    api = accept.prometheus_api(inventory.load(hosts).select()[0])
    assert api == accept.PrometheusAPI(
        stack.prometheus, str(tmp_path / "site-ca.pem"), USER, PASSWORD
    )
    assert PASSWORD not in repr(api)
    assert accept.prom_query(api, "vector(1)")[0]["value"][1] == "1"
    with pytest.raises(accept.PrometheusError, match=r"HTTP 401.*rlm_monitoring_username"):
        accept.prom_query(accept.PrometheusAPI(stack.prometheus, str(stack.ca)), "vector(1)")
    with pytest.raises(accept.PrometheusError, match=r"TLS fails.*rlm_monitoring_tls_ca"):
        accept.prom_query(
            accept.PrometheusAPI(stack.prometheus, str(stack.wrong_ca), USER, PASSWORD),
            "vector(1)",
        )


def test_basic_auth_is_on_by_default_with_a_login_generated_once(tmp_path: Path) -> None:
    """No rlm_monitoring_* setting at all: the role generates a login on the controller into the
    inventory's group_vars/all/ (mode 0600, no secret in the output), serves with it, hands it to
    Grafana's play in the same run (before Ansible ever read the new file), keeps it on the next
    run (nothing changes), and rlmctl reads the same login from the inventory."""
    grafana = tmp_path / "grafana"
    grafana_vars = {
        "grafana_provisioning_dir": str(grafana / "provisioning"),
        "grafana_dashboards_dir": str(grafana / "dashboards"),
        "grafana_group": "root",
        "grafana_install_package": False,
        "rlm_os_family": "Debian",
    }
    first_output, web_dir = run_monitoring_web(tmp_path, {}, grafana_vars)
    credentials = tmp_path / "group_vars" / "all" / "rlm-monitoring-credentials.yml"
    assert credentials.stat().st_mode & 0o777 == 0o600
    generated = yaml.safe_load(credentials.read_text())
    user, password = generated["rlm_monitoring_username"], generated["rlm_monitoring_password"]
    assert user == "rlm-ops" and len(password) >= 32
    web = yaml.safe_load((web_dir / "web-config.yml").read_text())
    assert list(web["basic_auth_users"]) == [user] and "tls_server_config" not in web
    assert bcrypt.checkpw(password.encode(), web["basic_auth_users"][user].encode())
    assert (web_dir / "password").read_text() == password
    assert password not in first_output and web["basic_auth_users"][user] not in first_output
    datasources = yaml.safe_load((grafana / "provisioning/datasources/rlm-ops.yml").read_text())
    [source] = datasources["datasources"]
    assert source["url"] == "http://mgmt1:9090"  # the mgmt host's address (its name here)
    assert (source["basicAuth"], source["basicAuthUser"]) == (True, user)
    assert source["secureJsonData"] == {"basicAuthPassword": password}

    second_output, _ = run_monitoring_web(tmp_path, {})
    assert yaml.safe_load(credentials.read_text()) == generated
    assert '"changed": true' not in second_output

    host = inventory.load(tmp_path / "hosts.yml").hosts["mgmt1"]
    assert (host.monitoring_username, host.monitoring_password) == (user, password)

    port = free_port()
    shipped = ROOT / "monitoring/prometheus/prometheus.yml"
    prometheus = start_prometheus(shipped, tmp_path, port, str(web_dir / "web-config.yml"))
    try:
        url = f"http://127.0.0.1:{port}/api/v1/status/buildinfo"
        wait_for(
            lambda: get(url, None, (user, password))[0] == 200, 60, "Prometheus with the login"
        )
        assert get(url, None)[0] == 401
        assert get(url, None, (user, "not-the-password"))[0] == 401
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)
