"""The wheelhouse manifest: what an offline wheelhouse holds and which nodes it fits.

A wheelhouse is a directory of wheels for ONE target (Python minor version, glibc floor, machine,
GPU vendor's torch build) plus two files written by its builder (`rlmctl wheelhouse`, rlmctl/
wheelhouse.py): `requirements.txt`, every wheel pinned with its sha256 (pip's hash-checking
mode), and `manifest.json`, the target, versions, sizes and hashes. The trainer_env role reads
the manifest (plugins/lookup/rlm_wheelhouse.py) to refuse a wheelhouse that cannot fit a node
before it copies anything, and compares manifests instead of bytes on a rerun.

Standard library only: the Ansible lookup imports it on the controller.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
REQUIREMENTS = "requirements.txt"
# The bundle alone, for nodes whose torch and dependencies come from a site stack (--no-deps).
BUNDLE_REQUIREMENTS = "requirements-bundle.txt"
FORMAT = 1
# PyTorch's CPU index: the torch build for nodes without a GPU (vendor none).
CPU_TORCH_INDEX_URL = "https://download.pytorch.org/whl/cpu"

# name-version(-build)?-python-abi-platform.whl (PEP 427)
_WHEEL = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl$"
)
_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(\w+)$")
# The legacy manylinux tags and the glibc each one means (PEP 600).
_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


class WheelhouseError(ValueError):
    """A wheelhouse that cannot be used: one line saying what and how to fix it."""


def normalize(name: str) -> str:
    """A project name as pip compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_wheel(filename: str) -> dict[str, str]:
    match = _WHEEL.match(filename)
    if not match:
        raise WheelhouseError(f"{filename} is not a wheel file name (name-version-py-abi-platform)")
    return match.groupdict()


def wheel_glibc(filename: str) -> tuple[int, int] | None:
    """The oldest glibc a wheel runs on (from its manylinux tags), None for a pure wheel."""
    floors = []
    for tag in parse_wheel(filename)["platform"].split("."):
        if tag == "any":
            return None
        match = _MANYLINUX.match(tag)
        if match:
            floors.append((int(match.group(1)), int(match.group(2))))
        elif tag.split("_")[0] in _LEGACY:
            floors.append(_LEGACY[tag.split("_")[0]])
    # A wheel tagged for several manylinux levels runs on the lowest of them.
    return min(floors) if floors else None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def requirement_lines(wheels: list[dict[str, Any]]) -> str:
    """requirements.txt for pip's hash-checking mode: every wheel pinned by version and hash."""
    return "".join(
        f"{w['name']}=={w['version']} --hash=sha256:{w['sha256']}\n"
        for w in sorted(wheels, key=lambda w: normalize(w["name"]))
    )


def digest_of(requirements: str) -> str:
    """The wheelhouse's identity: what pip installs from it, versions and hashes."""
    return hashlib.sha256(requirements.encode()).hexdigest()


def load(directory: str | Path) -> dict[str, Any]:
    """The manifest of `directory`, with every listed wheel present at its recorded size (a stat
    per file: the bytes are left to pip's hash check on the node)."""
    root = Path(directory)
    path = root / MANIFEST
    if not root.is_dir():
        raise WheelhouseError("is not a directory on the controller")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WheelhouseError(f"has no {MANIFEST} (it was not made by the builder)") from None
    except (OSError, ValueError) as error:
        raise WheelhouseError(f"has a {MANIFEST} that cannot be read ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise WheelhouseError(f"has a {MANIFEST} that is not a format-{FORMAT} manifest")
    for wheel in manifest["wheels"]:
        file = root / wheel["file"]
        try:
            size = file.stat().st_size
        except OSError:
            raise WheelhouseError(
                f"lacks {wheel['file']}, which its manifest lists: copy it whole again"
            ) from None
        if size != wheel["size"]:
            raise WheelhouseError(
                f"has {wheel['file']} at {size} bytes, its manifest says {wheel['size']}: "
                "copy it whole again"
            )
    return manifest


def build_command(
    python: str = "3.X", vendor: str = "none", glibc: str | None = None, out: str = "DIR"
) -> str:
    """The builder's command line for a target, as the role's messages print it."""
    glibc_option = f" --glibc {glibc}" if glibc else ""
    return (
        f"rlmctl wheelhouse --python {python} --vendor {vendor}{glibc_option} --out {out}"
        " (on a connected machine)"
    )


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def problems(
    manifest: dict[str, Any],
    *,
    python: str,
    glibc: str,
    machine: str,
    vendor: str,
    torch: str | None,
    bundle_version: str,
) -> list[str]:
    """Why this wheelhouse does not fit a node: [] when it does.

    python: the node's venv interpreter as "3.13"; glibc: "2.36"; machine: "x86_64"; vendor: the
    node's GPU vendor (none, amd, nvidia); torch: the version the node needs from the wheelhouse,
    None when torch comes from elsewhere (a site stack) and only the bundle is taken from it.
    """
    target = manifest["target"]
    found = []
    if manifest["bundle"]["version"] != bundle_version:
        found.append(
            f"holds {manifest['bundle']['name']} {manifest['bundle']['version']}, the nodes need "
            f"{bundle_version} (trainer_env_bundle_version)"
        )
    if torch is None:
        return found  # the bundle wheel is pure Python: any interpreter, any platform
    if manifest.get("torch") is None:
        found.append("holds only the bundle (built with --bundle-only), no torch")
        return found
    if manifest["torch"].split("+")[0] != torch:
        found.append(f"holds torch {manifest['torch']}, the nodes need {torch}")
    if target["python"] != python:
        found.append(
            f"is built for Python {target['python']} (cp{target['python'].replace('.', '')}), "
            f"this node's venv Python is {python}"
        )
    if target["vendor"] != vendor:
        found.append(f"holds the torch build for vendor {target['vendor']}, this node is {vendor}")
    if target.get("machine") and target["machine"] != machine:
        found.append(f"is built for {target['machine']}, this node is {machine}")
    if target.get("glibc") and _version_tuple(target["glibc"]) > _version_tuple(glibc):
        found.append(f"needs glibc {target['glibc']}, this node has {glibc}")
    return found
