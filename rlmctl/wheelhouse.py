"""`rlmctl wheelhouse`: build, on a connected machine, the offline wheelhouse for one node target.

A target is the nodes' Python minor version (3.11 on Debian 12, 3.13 on Debian 13), their glibc
and machine, and the GPU vendor whose torch build they run. The builder

1. builds the bundle's wheel (from this checkout, or --bundle: a wheel or a source tree),
2. downloads torch from the vendor's index alone (`--index-url`, never `--extra-index-url`: pip
   would take PyPI's build where the vendor index lacks the version), then the bundle with its
   `[train]` extra and every dependency, for the target's tags (`pip download --python-version
   --abi --platform --only-binary=:all:`), torch held at the exact build just downloaded,
3. writes `requirements.txt` (every wheel pinned with its sha256: pip's hash-checking mode on the
   nodes) and `manifest.json` (target, versions, sizes, hashes: clusterspec/wheelhouse.py),
4. installs it offline into a clean venv of the target's Python (no index, no pip configuration)
   and imports torch and the trainer there, before the directory is moved into place.

The manifest is what the trainer_env role checks before copying anything to a node.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from clusterspec import wheelhouse as spec
from rlmctl.errors import RlmctlError

SOURCE_TREE = Path(__file__).resolve().parents[1]
BUNDLE_PACKAGES = ("runcontract", "trainer", "rlmctl", "monitoring", "clusterspec")
BUNDLE_FILES = ("pyproject.toml", "README.md")
PIP_TIMEOUT_S = 3600
PIP = (sys.executable, "-m", "pip")

# Run in the clean venv: what a node's trainer needs, imported for real.
PROBE = r"""
import importlib.metadata as md, json, sys
import torch
x = torch.ones(4, 4)
assert float((x @ x).sum()) == 64.0
import trainer.model, trainer.train, rlmctl.cli, monitoring.exporter
print(json.dumps({"python": "%d.%d.%d" % sys.version_info[:3], "torch": torch.__version__,
                  "cuda": torch.version.cuda, "hip": torch.version.hip,
                  "bundle": md.version(sys.argv[1])}))
"""


@dataclass(frozen=True)
class Target:
    python: str  # "3.13"
    vendor: str  # none | amd | nvidia
    glibc: str  # oldest glibc of the nodes, "2.36"
    machine: str  # "x86_64"
    torch_index: str

    def pip_args(self) -> list[str]:
        """pip download's options that select wheels for the target instead of this machine."""
        major, minor = (int(p) for p in self.glibc.split(".")[:2])
        if major != 2 or minor < 17:
            raise RlmctlError(f"--glibc {self.glibc}: the nodes need glibc 2.17 or newer")
        platforms = [f"manylinux_2_{m}_{self.machine}" for m in range(minor, 16, -1)]
        platforms += [f"manylinux{legacy}_{self.machine}" for legacy in ("2014", "2010", "1")]
        abi = "cp" + self.python.replace(".", "")
        args = ["--only-binary=:all:", "--python-version", self.python, "--implementation", "cp"]
        args += [item for a in (abi, "abi3", "none") for item in ("--abi", a)]
        return args + [item for p in platforms for item in ("--platform", p)]


def this_glibc() -> str:
    name, version = platform.libc_ver()
    return version if name == "glibc" and version else "2.17"


def torch_index_for(vendor: str) -> str:
    from clusterspec.vendors import VENDORS

    if vendor == "none":
        return spec.CPU_TORCH_INDEX_URL
    if vendor not in VENDORS:
        raise RlmctlError(f"--vendor {vendor}: use none or one of {', '.join(sorted(VENDORS))}")
    return VENDORS[vendor].TORCH_INDEX_URL


def _pip(argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
            check=False,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise RlmctlError(f"{what}: pip ran over {PIP_TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = [
            line
            for line in (done.stderr + done.stdout).splitlines()
            if line.strip() and not line.startswith("WARNING: Location")
        ]
        raise RlmctlError(f"{what} failed: {' / '.join(lines[-3:]) or f'exit {done.returncode}'}")
    return done.stdout


def build_bundle(source: Path | None, dest: Path) -> Path:
    """The bundle's wheel in `dest`: `source` itself when it is a wheel, else built from the
    source tree (a copy of it, so that the checkout gets no build artefacts)."""
    source = source or SOURCE_TREE
    if source.is_file() and source.suffix == ".whl":
        return Path(shutil.copy2(source, dest))
    if not (source / "pyproject.toml").is_file():
        raise RlmctlError(
            f"--bundle {source}: neither a wheel nor a source tree with pyproject.toml "
            "(pass the rlm-ops wheel or checkout to build from)"
        )
    with tempfile.TemporaryDirectory(prefix="rlm-bundle-") as tmp:
        copy = Path(tmp) / "src"
        copy.mkdir()
        for name in BUNDLE_FILES:
            shutil.copy2(source / name, copy / name)
        for package in BUNDLE_PACKAGES:
            shutil.copytree(
                source / package, copy / package, ignore=shutil.ignore_patterns("__pycache__")
            )
        argv = [*PIP, "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
        _pip(
            [*argv, "--wheel-dir", str(dest), str(copy)],
            f"building the bundle's wheel from {source}",
        )
    return next(dest.glob("*.whl"))


def bundle_metadata(wheel: Path) -> tuple[str, str, str | None]:
    """(name, version, torch pin of the [train] extra) from the wheel's METADATA."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    fields = dict(
        line.split(": ", 1) for line in text.splitlines() if ": " in line and line[0] != " "
    )
    pin = re.search(r"^Requires-Dist: torch==([^\s;]+).*extra == .train.", text, re.MULTILINE)
    return fields["Name"], fields["Version"], pin.group(1) if pin else None


def describe(directory: Path, bundle: Path, extras: list[str]) -> dict[str, Any]:
    """Every wheel of `directory` (name, version, size, sha256): one version per project."""
    wheels: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for path in sorted(directory.glob("*.whl")):
        parsed = spec.parse_wheel(path.name)
        name = spec.normalize(parsed["name"])
        if name in seen:
            raise RlmctlError(
                f"two versions of {name} were downloaded ({seen[name]}, {path.name}): "
                "pin it in the bundle's requirements"
            )
        seen[name] = path.name
        wheels.append(
            {
                "file": path.name,
                "name": name,
                "version": parsed["version"],
                "size": path.stat().st_size,
                "sha256": spec.sha256(path),
            }
        )
    name, version, _ = bundle_metadata(bundle)
    floors = [g for w in wheels if (g := spec.wheel_glibc(w["file"]))]
    return {
        "wheels": wheels,
        "bundle": {"name": spec.normalize(name), "version": version, "extras": extras},
        "glibc": "{}.{}".format(*max(floors)) if floors else None,
    }


def clean_pip_env() -> dict[str, str]:
    """An environment in which pip reads no configuration: only what the command line says."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def verify(directory: Path, python_exe: str, bundle_name: str, bundle_only: bool) -> dict[str, Any]:
    """Install the wheelhouse offline into a clean venv of `python_exe`; import torch and the
    trainer there. Returns what the venv reports."""
    with tempfile.TemporaryDirectory(prefix="rlm-wheelhouse-verify-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python_exe, "-m", "venv", str(venv)], check=True, capture_output=True)
        requirements = spec.BUNDLE_REQUIREMENTS if bundle_only else spec.REQUIREMENTS
        # --no-compile: this venv is thrown away; byte-compiling torch would only cost minutes.
        argv = [str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "--no-compile"]
        argv += ["--no-index"]
        argv += ["--find-links", str(directory), "--require-hashes"]
        argv += ["--no-deps"] if bundle_only else []
        _pip(
            [*argv, "-r", str(directory / requirements)],
            f"installing the wheelhouse offline into a clean venv of {python_exe}",
            env=clean_pip_env(),
        )
        if bundle_only:
            code = "import importlib.metadata as m, json, sys; print(json.dumps({'bundle': m.version(sys.argv[1])}))"
        else:
            code = PROBE
        out = _pip(
            [str(venv / "bin/python"), "-c", code, bundle_name],
            f"importing torch and the trainer in the clean venv of {python_exe}",
            env=clean_pip_env(),
        )
        return json.loads(out.strip().splitlines()[-1])


def python_of(python_exe: str) -> str:
    out = subprocess.run(
        [python_exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RlmctlError(f"--python-exe {python_exe} does not run: {out.stderr.strip()[-200:]}")
    return out.stdout.strip()


def build(
    target: Target,
    out: Path,
    *,
    bundle_source: Path | None = None,
    torch_version: str | None = None,
    bundle_only: bool = False,
    python_exe: str | None = None,
    check: bool = True,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build the wheelhouse for `target` into `out` (which must not exist yet); its manifest."""
    if out.exists() and any(out.iterdir()):
        raise RlmctlError(f"--out {out} exists and is not empty: a wheelhouse is built whole")
    if check:
        here = "{}.{}".format(*sys.version_info[:2])
        python_exe = python_exe or (
            sys.executable if here == target.python else shutil.which(f"python{target.python}")
        )
        if bundle_only:  # a pure-Python wheel: any interpreter verifies it
            python_exe = python_exe or sys.executable
        elif not python_exe:
            raise RlmctlError(
                f"no python{target.python} on PATH to verify the wheelhouse with: install the "
                f"nodes' Python {target.python} here or pass --python-exe (--no-verify skips it)"
            )
        if not bundle_only and (found := python_of(python_exe)) != target.python:
            raise RlmctlError(f"--python-exe {python_exe} is Python {found}, not {target.python}")
    started = time.monotonic()

    def step(message: str) -> None:
        say(f"[{time.monotonic() - started:4.0f} s] {message}")

    staging = out.with_name(f".{out.name}.building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        bundle = build_bundle(bundle_source, staging)
        name, version, pinned = bundle_metadata(bundle)
        torch = None if bundle_only else (torch_version or pinned)
        if not bundle_only and torch is None:
            raise RlmctlError(f"{bundle.name} pins no torch in [train]: pass --torch VERSION")
        if torch:
            step(f"torch {torch} for vendor {target.vendor} from {target.torch_index}")
            download = [*PIP, "download", "--quiet", "--dest", str(staging), *target.pip_args()]
            _pip(
                [*download, "--no-deps", "--index-url", target.torch_index, f"torch=={torch}"],
                f"downloading torch=={torch} for Python {target.python} from {target.torch_index}",
            )
            torch_wheel = next(staging.glob("torch-*.whl"))
            exact = spec.parse_wheel(torch_wheel.name)["version"]
            step(f"{torch_wheel.name}; now {name}[train] {version} and every dependency")
            # torch held at the exact build just downloaded (a local label such as +rocm6.2
            # exists on the vendor's index only); its dependencies may live there too.
            sources = ["--find-links", str(staging), "--extra-index-url", target.torch_index]
            _pip(
                [*download, *sources, f"{bundle}[train]", f"torch=={exact}"],
                f"downloading {name}[train] {version} and its dependencies for Python "
                f"{target.python}",
            )
        described = describe(staging, bundle, [] if bundle_only else ["train"])
        step(f"{len(described['wheels'])} wheels hashed")
        requirements = spec.requirement_lines(described["wheels"])
        (staging / spec.REQUIREMENTS).write_text(requirements)
        bundle_line = spec.requirement_lines(
            [w for w in described["wheels"] if w["name"] == described["bundle"]["name"]]
        )
        (staging / spec.BUNDLE_REQUIREMENTS).write_text(bundle_line)
        manifest: dict[str, Any] = {
            "format": spec.FORMAT,
            "target": {
                **asdict(target),
                "python": None if bundle_only else target.python,
                "glibc": described["glibc"],
            },
            "torch": None
            if bundle_only
            else next(w["version"] for w in described["wheels"] if w["name"] == "torch"),
            "bundle": described["bundle"],
            "digest": spec.digest_of(requirements),
            "wheels": described["wheels"],
            "built": {
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "on": socket.gethostname(),
            },
            "verified": None,
        }
        if check:
            assert python_exe, "chosen above when check is set"
            step(f"installing it offline into a clean venv of {python_exe}")
            manifest["verified"] = {
                **verify(staging, python_exe, described["bundle"]["name"], bundle_only),
                "with": python_exe,
            }
        (staging / spec.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    size = sum(w["size"] for w in manifest["wheels"])
    step(
        f"{out}: {len(manifest['wheels'])} wheels, {size / 2**20:.0f} MiB, for Python "
        f"{target.python} / glibc >= {manifest['target']['glibc']} / {target.machine} / vendor "
        f"{target.vendor}{'' if check else ' (NOT verified)'}"
    )
    return manifest


def command(
    out: Annotated[Path, typer.Option("--out", help="Directory to create (rlm_wheelhouse).")],
    python: Annotated[
        str,
        typer.Option(help="The nodes' Python minor version: 3.11 on Debian 12, 3.13 on Debian 13."),
    ],
    vendor: Annotated[
        str, typer.Option(help="GPU vendor whose torch build to take: none, amd, nvidia.")
    ] = "none",
    torch: Annotated[
        str | None, typer.Option(help="torch version (default: the bundle's \\[train] pin).")
    ] = None,
    torch_index_url: Annotated[
        str | None, typer.Option(help="Index holding that torch build (default: the vendor's).")
    ] = None,
    glibc: Annotated[
        str | None, typer.Option(help="Oldest glibc of the nodes (default: this machine's).")
    ] = None,
    machine: Annotated[
        str | None, typer.Option(help="The nodes' machine (default: this machine's).")
    ] = None,
    bundle: Annotated[
        Path | None,
        typer.Option(help="rlm-ops wheel or source tree (default: this rlmctl's checkout)."),
    ] = None,
    bundle_only: Annotated[
        bool, typer.Option(help="Only the bundle: for nodes with a site stack (torch there).")
    ] = False,
    python_exe: Annotated[
        str | None, typer.Option(help="Interpreter to verify with (default: pythonX.Y on PATH).")
    ] = None,
    check: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Install offline into a clean venv.")
    ] = True,
    as_json: Annotated[
        bool, typer.Option("--json", help='{"wheelhouse": ..., "manifest": ...} on stdout.')
    ] = False,
) -> None:
    """Build the offline wheelhouse for one node target (run it on a connected machine)."""
    from rlmctl import render

    if not re.fullmatch(r"3\.\d+", python):
        raise RlmctlError(f"--python {python}: give the minor version, e.g. 3.11 or 3.13")
    target = Target(
        python=python,
        vendor=vendor,
        glibc=glibc or this_glibc(),
        machine=machine or platform.machine(),
        torch_index=torch_index_url or torch_index_for(vendor),
    )
    manifest = build(
        target,
        out,
        bundle_source=bundle,
        torch_version=torch,
        bundle_only=bundle_only,
        python_exe=python_exe,
        check=check,
        say=render.say(),
    )
    if as_json:
        render.emit_json({"wheelhouse": str(out.resolve()), "manifest": manifest})
    else:
        render.line(f"set rlm_wheelhouse: {out.resolve()} for the nodes of this target")
