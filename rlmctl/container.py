"""The trainer in an OCI image (`rlm_container_image`): what Slurm's srun (pyxis) is given.

The image (tests/rig/container.py builds one offline) has the bundle's wheels installed for the
image's own `python3`, which then runs the batch script's node wrapper and the trainer. The host's
shared directory (run directories, data, checkpoints) is mounted at the same path, so the paths
in the batch script and the config mean the same inside and out.

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
