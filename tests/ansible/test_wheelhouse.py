"""The wheelhouse builder (`rlmctl wheelhouse`) and its manifest, without the rig.

The full wheelhouses (torch and every dependency, cp311 and cp313) are built, installed offline on
Debian 12 and 13 systemd nodes and rerun in tests/ansible/test_site_systemd.py; here: bad input,
and what the manifest and pip's hash-checking mode catch, on a bundle-only wheelhouse.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clusterspec import wheelhouse as spec
from rlmctl import wheelhouse
from tests.ansible.playbook_run import REPO
from tests.rlmctl.conftest import assert_one_line_error, rlmctl

PYTHON = "{}.{}".format(*sys.version_info[:2])


@pytest.fixture(scope="module")
def bundle_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`rlmctl wheelhouse --bundle-only`, verified into a clean venv."""
    out = tmp_path_factory.mktemp("wheelhouse") / "bundle-only"
    result = rlmctl("wheelhouse", "--python", PYTHON, "--bundle-only", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert f"set rlm_wheelhouse: {out}" in result.stdout
    return out


@pytest.mark.integration
def test_bundle_only_wheelhouse_has_a_verified_manifest(bundle_only: Path) -> None:
    manifest = json.loads((bundle_only / spec.MANIFEST).read_text())
    [wheel] = manifest["wheels"]
    assert wheel["file"] == "rlm_ops-0.1.0-py3-none-any.whl"
    assert manifest["bundle"] == {"name": "rlm-ops", "version": "0.1.0", "extras": []}
    assert manifest["torch"] is None and manifest["target"]["python"] is None
    assert manifest["verified"]["bundle"] == "0.1.0"
    requirements = (bundle_only / spec.REQUIREMENTS).read_text()
    assert requirements == f"rlm-ops==0.1.0 --hash=sha256:{wheel['sha256']}\n"
    assert manifest["digest"] == spec.digest_of(requirements)
    assert spec.load(bundle_only)["digest"] == manifest["digest"]
    # Fits any node that takes torch elsewhere; not one that needs torch from it.
    node = {"python": "3.13", "glibc": "2.41", "machine": "x86_64", "vendor": "none"}
    assert spec.problems(manifest, **node, torch=None, bundle_version="0.1.0") == []
    assert spec.problems(manifest, **node, torch="2.13.0", bundle_version="0.1.0") == [
        "holds only the bundle (built with --bundle-only), no torch"
    ]
    assert spec.problems(manifest, **node, torch=None, bundle_version="0.2.0") == [
        "holds rlm-ops 0.1.0, the nodes need 0.2.0 (trainer_env_bundle_version)"
    ]


def test_a_wheel_altered_on_the_way_is_refused(bundle_only: Path, tmp_path: Path) -> None:
    """Same size, one byte changed: the manifest's sizes pass, pip's hash check refuses it.
    Truncated: the manifest check refuses it on the controller, before any copy."""
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(bundle_only), str(copy)], check=True)
    wheel = copy / "rlm_ops-0.1.0-py3-none-any.whl"
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 0xFF
    wheel.write_bytes(bytes(data))
    assert spec.load(copy)  # sizes match
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install"]
    offline = ["--no-index", "--find-links", str(copy), "--require-hashes", "--no-deps"]
    install = subprocess.run(
        [*pip, *offline, "-r", str(copy / spec.BUNDLE_REQUIREMENTS)],
        capture_output=True,
        text=True,
        env=wheelhouse.clean_pip_env(),
        check=False,
    )
    assert install.returncode != 0
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in install.stderr, install.stderr
    wheel.write_bytes(bytes(data[:-10]))
    with pytest.raises(spec.WheelhouseError, match=r"has rlm_ops-0\.1\.0-py3-none-any\.whl at"):
        spec.load(copy)


def test_the_builder_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    out = str(tmp_path / "wh")
    assert_one_line_error(
        rlmctl("wheelhouse", "--python", "3", "--out", out), 2, "--python 3: give the minor"
    )
    assert_one_line_error(
        rlmctl("wheelhouse", "--python", "3.13", "--vendor", "intel", "--out", out),
        2,
        "--vendor intel: use none or one of amd, nvidia",
    )
    assert_one_line_error(
        rlmctl("wheelhouse", "--python", "3.13", "--python-exe", sys.executable, "--out", out),
        2,
        f"--python-exe {sys.executable} is Python {PYTHON}, not 3.13",
    )
    (tmp_path / "wh").mkdir()
    (tmp_path / "wh" / "old.whl").write_text("")
    assert_one_line_error(
        rlmctl("wheelhouse", "--python", PYTHON, "--out", out),
        2,
        f"--out {out} exists and is not empty: a wheelhouse is built whole",
    )
    assert_one_line_error(
        rlmctl(
            "wheelhouse", "--python", PYTHON, "--bundle", str(REPO / "docs"), "--out", out + "2"
        ),
        2,
        f"--bundle {REPO / 'docs'}: neither a wheel nor a source tree with pyproject.toml",
    )


def test_wheel_tags_give_the_glibc_a_wheel_needs() -> None:
    """File names as pip downloaded them for the cp311 and cp313 wheelhouses."""
    assert spec.wheel_glibc("bcrypt-5.0.0-cp39-abi3-manylinux_2_34_x86_64.whl") == (2, 34)
    assert spec.wheel_glibc(
        "markupsafe-3.0.4-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64"
        ".manylinux_2_28_x86_64.whl"
    ) == (2, 17)
    assert spec.wheel_glibc("nvidia_cuda_nvrtc-13.0.88-py3-none-manylinux2010_x86_64.whl") == (
        2,
        12,
    )
    assert spec.wheel_glibc("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl") == (2, 28)
    assert spec.wheel_glibc("rich-15.0.0-py3-none-any.whl") is None
    assert spec.parse_wheel("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")[
        "version"
    ] == ("2.13.0+cpu")
