#!/usr/bin/python3
"""Stand-in `nvidia-container-runtime`: like the real one, an OCI runtime that adds NVIDIA's prestart hook to the
bundle's config.json when the container asks for GPUs (NVIDIA_VISIBLE_DEVICES), then hands over to runc."""

import json
import os
import sys

HOOK = "/usr/bin/nvidia-container-runtime-hook"


def add_hook(bundle: str) -> None:
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        spec = json.load(f)
    env = dict(e.split("=", 1) for e in spec.get("process", {}).get("env", []) if "=" in e)
    if env.get("NVIDIA_VISIBLE_DEVICES", "void") in ("void", ""):
        return
    prestart = spec.setdefault("hooks", {}).setdefault("prestart", [])
    if any(h.get("path") == HOOK for h in prestart):
        return  # docker's --gpus driver already put it there
    prestart.insert(0, {"path": HOOK, "args": [HOOK, "prestart"]})
    with open(path, "w") as f:
        json.dump(spec, f)


def main(argv) -> None:
    if "create" in argv:
        bundle = next((argv[i + 1] for i, a in enumerate(argv) if a in ("--bundle", "-b")), os.getcwd())
        add_hook(bundle)
    os.execvp("runc", ["runc", *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
