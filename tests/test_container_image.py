"""The trainer's OCI image (tests/rig/container.py), built offline from the rig's Debian root and
a wheelhouse of the bundle and its dependencies, and run with podman: 2 training steps on the
bundled corpus, CPU, no network. Built once per content of its inputs; the second ensure finds
it by its tag. Both times are printed (the cached one is what the suite pays after a change-free
run; a fresh CI machine pays the build). Then rlmctl runs a job in it on two rig hosts over SSH
(rlm_container_image): launch, status, a clean stop.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import tomllib
import yaml

from tests.ansible.rig_site import build_wheelhouse
from tests.goodput_faults import prepare_data
from tests.rig import Rig, container
from tests.rig.image import IMAGE_ROOT
from tests.rlmctl.conftest import rlmctl, wait_for
from tests.rlmctl.test_cluster import status_of
from trainer.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(1800)


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the trainer image is built as root (podman's system storage)"
    for tool in ("podman", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"the trainer image needs {tool} (apt-get install {tool})"
    return None


def dependency_wheels() -> Path:
    """The bundle's dependencies (its [train] extra included) as wheels, downloaded from the
    package index once per requirement list into a directory the suite keeps."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = sorted(project["dependencies"] + project["optional-dependencies"]["train"])
    key = hashlib.sha256(json.dumps([sys.version_info[:2], wanted]).encode()).hexdigest()[:12]
    cache = IMAGE_ROOT / f"wheels-{key}"
    if not (cache / "ready").exists():
        staging = cache.with_name(f".{cache.name}.building")
        shutil.rmtree(staging, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
             "--only-binary=:all:", "--dest", str(staging), *wanted],
            check=True, capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
        (staging / "ready").write_text("\n".join(wanted) + "\n")
        shutil.rmtree(cache, ignore_errors=True)
        staging.rename(cache)
    return cache


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if reason := unavailable():
        pytest.skip(reason)
    out = build_wheelhouse(tmp_path_factory.mktemp("image") / "wheelhouse")
    for wheel in dependency_wheels().glob("*.whl"):
        (out / wheel.name).symlink_to(wheel)
    return out


@pytest.fixture(scope="module")
def image(wheelhouse: Path) -> container.TrainerImage:
    first = container.ensure_trainer_image(wheelhouse)
    again = container.ensure_trainer_image(wheelhouse)
    print(
        f"\ntrainer image {first.ref}: {first.seconds:.1f}s "
        f"({'built ' + ', '.join(first.built) if first.built else 'cached'}); "
        f"again {again.seconds:.1f}s ({'cached' if not again.built else 'built'})"
    )
    assert again.ref == first.ref and again.built == ()
    return first


@pytest.mark.integration
def test_the_image_trains_two_steps_offline(image: container.TrainerImage, tmp_path: Path) -> None:
    run = subprocess.run(
        [*container.run_argv("--volume", f"{tmp_path}:/work"), image.ref, "sh", "-c",
         "cd /work && python3 -m trainer prepare --out data --seq-len 64 && "
         "python3 -m trainer train --config $(python3 -c 'import trainer, pathlib; "
         "print(pathlib.Path(trainer.__file__).parent / \"configs/tiny.yaml\")') "
         "data.path=data run_dir=run train.steps=2 train.micro_batch=8 eval.every=0"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["state"], status["step"]) == ("done", 2), status


def test_the_image_is_labelled_with_its_inputs_and_a_changed_input_is_a_new_image(
    image: container.TrainerImage, wheelhouse: Path, tmp_path: Path
) -> None:
    labels = json.loads(container.podman("image", "inspect", image.ref))[0]["Labels"]
    assert labels[container.INPUTS_LABEL] == image.key
    assert image.ref.endswith(":" + image.key)
    # A wheelhouse without one of the dependencies is other inputs: another tag, not this image.
    fewer = tmp_path / "wheelhouse"
    fewer.mkdir()
    for wheel in sorted(wheelhouse.glob("*.whl"))[1:]:
        (fewer / wheel.name).symlink_to(wheel.resolve())
    assert container.image_keys(fewer)[2] != image.key
    # A bundle wheel rebuilt from the same sources is the same input.
    rebuilt = build_wheelhouse(tmp_path / "rebuilt" / "wheelhouse")
    (bundle,) = rebuilt.glob("rlm_ops-*.whl")
    (original,) = wheelhouse.glob("rlm_ops-*.whl")
    assert container.wheel_key(bundle) == container.wheel_key(original)


@pytest.mark.rig
@pytest.mark.integration
def test_rlmctl_runs_each_hosts_torchrun_in_the_image_over_ssh(
    image: container.TrainerImage, make_rig: Callable[[int], Rig]
) -> None:
    """rlm_container_image over SSH with the real image and podman: `rlmctl launch` on two rig
    hosts (real sshd, SSH from the CLI) runs each host's torchrun in `podman run` of the image;
    the ranks meet over the host network and train; `status` finds the container's processes
    (by the run's variables, as any), and `stop` checkpoints and ends them: no process and no
    container is left. rlm_container_options carries the limits this machine kind allows
    (no CAP_SYS_RESOURCE here: see container.run_argv)."""
    rig = make_rig(2)
    for host in rig.hosts:
        container.prepare_podman_host(rig, host.name)
    prepare_data(rig.shared_dir, REPO)
    inventory = yaml.safe_load(rig.inventory_path.read_text())
    inventory["all"]["vars"] |= {
        "rlm_container_image": image.ref,
        "rlm_container_options": container.limit_options(),
    }
    path = rig.state_dir / "container-inventory.yml"
    path.write_text(yaml.safe_dump(inventory))
    inv = ["-i", str(path)]
    run = "in-image"
    overrides = ["data.path=data", "train.steps=100000", "train.global_batch=8", "eval.every=0"]
    config = str(REPO / "trainer/configs/tiny.yaml")
    launched = rlmctl(*inv, "launch", "--config", config, "--name", run, *overrides, timeout=300)
    assert launched.returncode == 0, launched.stderr
    run_dir = rig.shared_dir / "runs" / run

    try:
        # The run directory is polled (a file read), `rlmctl status` asked once it is there.
        wait_for(lambda: (RunDir(run_dir).read_status().get("step") or 0) >= 3, 300,
                 "step 3 in the image on both hosts")  # fmt: skip
        running = status_of(path, run)
        assert running["state"] == "running", running
        assert [h["alive"] for h in running["hosts"]] == [True, True], running["hosts"]
        # torchrun and the trainers (every python of the run) run in containers: in PID
        # namespaces of their own (the rig's hosts share the machine's). The launcher's shell
        # and podman carry run_dir= in their command lines too, outside.
        listing = rig.exec(
            "node1",
            "me=$(readlink /proc/self/ns/pid); "
            f"for pid in $(pgrep -f '[r]un_dir={run_dir}'); do "
            '[ "$(readlink /proc/$pid/ns/pid)" = "$me" ] && where=outside || where=container; '
            "echo $where $(head -c 200 /proc/$pid/cmdline | tr '\\0' ' '); done",
        ).stdout.splitlines()
        pythons = [row.split()[0] for row in listing if "python" in row.split()[1]]
        assert len(pythons) >= 4 and set(pythons) == {"container"}, listing
        for host in rig.hosts:
            assert rig.exec(host, "podman ps --quiet").stdout.strip(), host.name
    finally:
        stopped = rlmctl(*inv, "stop", run, "--timeout", "60", timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    final = status_of(path, run)
    assert final["state"] == "stopped" and final["checkpoint"]["valid"], final
    for host in rig.hosts:
        assert rig.exec(host, f"pgrep -af '[r]un_dir={run_dir}' || true").stdout.strip() == ""
        assert rig.exec(host, "podman ps --all --quiet").stdout.strip() == "", host.name
