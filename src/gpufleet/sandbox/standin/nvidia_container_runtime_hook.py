#!/usr/bin/python3
"""Stand-in `nvidia-container-runtime-hook prestart`: checks the requested GPUs against the host's as the real hook
does, and gives the container an nvidia-smi showing only its GPUs, renumbered from 0."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    # On the host, main() imports the module's copy from MODULE_DIR.
    from gpufleet.sandbox.nvidia_smi import Profile

PROFILE = "/etc/gpufleet-standin/nvidia-smi.json"
MODULE_DIR = "/usr/lib/gpufleet-standin"


def fail(message: str) -> NoReturn:
    sys.stderr.write(message + "\n")
    sys.exit(1)


def main() -> None:
    state = json.load(sys.stdin)
    bundle = state["bundle"]
    with open(os.path.join(bundle, "config.json")) as f:
        spec = json.load(f)
    env = dict(e.split("=", 1) for e in spec.get("process", {}).get("env", []) if "=" in e)
    wanted = env.get("NVIDIA_VISIBLE_DEVICES", "")
    if wanted in ("", "void", "none"):
        return
    if not os.path.exists(PROFILE):
        fail(
            "nvidia-container-cli: initialization error: load library failed: libnvidia-ml.so.1: "
            "cannot open shared object file: no such file or directory: unknown"
        )
    sys.path.insert(0, MODULE_DIR)
    nvidia_smi = importlib.import_module("nvidia_smi")  # the host's stand-in module
    with open(PROFILE) as f:
        profile: Profile = nvidia_smi.Profile.from_json(f.read())
    by_id = {str(g.index): g for g in profile.gpus} | {g.uuid: g for g in profile.gpus}
    chosen = profile.gpus if wanted == "all" else []
    for dev in [] if wanted == "all" else wanted.split(","):
        if dev.strip() not in by_id:
            fail(f"nvidia-container-cli: device error: {dev.strip()}: unknown device: unknown")
        chosen.append(by_id[dev.strip()])
    root = spec["root"]["path"]
    root = root if os.path.isabs(root) else os.path.join(bundle, root)
    if os.path.exists(os.path.join(root, "usr/bin/python3")):
        visible = [dataclasses.replace(g, index=i) for i, g in enumerate(chosen)]
        nvidia_smi.write_host_files(Path(root), dataclasses.replace(profile, gpus=visible))


if __name__ == "__main__":
    main()
