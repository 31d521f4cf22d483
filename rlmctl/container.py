"""The trainer in an OCI image (`rlm_container_image`): what Slurm's srun (pyxis) is given.

The image (tests/rig/container.py builds one offline) has the bundle's wheels installed for the
image's own `python3`, which then runs the batch script's node wrapper and the trainer. The host's
shared directory (run directories, data, checkpoints) is mounted at the same path, so the paths
in the batch script and the config mean the same inside and out.

Over SSH (podman): `podman_argv`, the launcher runs torchrun in `podman run`; rlmctl finds and
signals the container's processes like any (by the run's variables in their environment).

Under Slurm with pyxis (srun's `--container-image` and `--container-mounts`, enroot under it):
`rlm_container_image` is what `--container-image` takes (an enroot squashfs on the shared
directory, or a registry reference the site can pull). `rlm_container_options` are more srun
options of pyxis (`--container-env=...`, `--container-mounts=/scratch`).
"""

from __future__ import annotations

import re

from clusterspec.inventory import Host
from rlmctl.errors import RlmctlError

IMAGE_PYTHON = "python3"  # the image's interpreter (the wheels are installed for it)
# pyxis options rlmctl sets itself (refused in rlm_container_options under Slurm).
OWN_PYXIS = ("--container-image", "--container-workdir")


def podman_argv(host: Host, env_names: list[str]) -> list[str]:
    """Over SSH: `podman run` of the image up to its python3, for the launcher to start torchrun
    in. Host network and IPC (the rendezvous and NCCL's shared memory), the shared directory at
    its own path as the working directory, the named variables passed on from the launcher's
    environment (`--env NAME`: the run and host that find the processes, NCCL's settings), then
    rlm_container_options (GPU devices: `--device=nvidia.com/gpu=all` with CDI, or
    `--device=/dev/kfd --device=/dev/dri` for AMD)."""
    shared = host.shared_dir.rstrip("/") or "/"
    argv = ["podman", "run", "--rm", "--network=host", "--ipc=host"]
    argv += [f"--volume={shared}:{shared}", f"--workdir={shared}"]
    argv += [f"--env={name}" for name in sorted(set(env_names))]
    for option in host.container_options:
        if not option.startswith("-") or "\n" in option:
            raise RlmctlError(
                f"rlm_container_options: {option!r} is not a podman run option (like "
                "--device=/dev/kfd); fix it in the inventory"
            )
    return [*argv, *host.container_options, check_image(host.container_image or ""), IMAGE_PYTHON]


def check_image(image: str) -> str:
    """One word: a registry reference, `localhost/name:tag`, or a squashfs path."""
    if not image or re.search(r"\s", image):
        raise RlmctlError(
            f"rlm_container_image must be one image reference or .sqsh path, got {image!r}"
        )
    return image


def pyxis_options(host: Host, image: str) -> list[str]:
    """srun's pyxis options for the trainer's step: the image, the shared directory mounted at
    its own path and made the working directory, then the site's rlm_container_options."""
    shared = host.shared_dir.rstrip("/") or "/"
    out = [
        f"--container-image={check_image(image)}",
        f"--container-mounts={shared}:{shared}",
        f"--container-workdir={shared}",
    ]
    for option in host.container_options:
        if not option.startswith("--container-") or "\n" in option:
            raise RlmctlError(
                f"rlm_container_options: {option!r} is not a pyxis srun option (like "
                "--container-env=NCCL_DEBUG); fix it in the inventory"
            )
        if option.split("=", 1)[0] in OWN_PYXIS:
            raise RlmctlError(
                f"rlm_container_options: {option.split('=', 1)[0]} is set by rlmctl from "
                f"rlm_container_image; remove {option!r}"
            )
        out.append(option)
    return out
