#!/usr/bin/python3
"""Stand-in `nvidia-ctk` (NVIDIA Container Toolkit CLI) for the sandbox hosts; stdlib only.

Behaves like the real 1.17 CLI where a deploy depends on it; `runtime configure` merges into daemon.json, sorted
with 4-space indent as Go's encoder writes it.
"""

import argparse
import json
import os
import sys
from typing import Any

VERSION = "1.17.8"
COMMIT = "f202b80a9b9d0db00d9b1d73c0128c8962c55f4d"


def configure(args: argparse.Namespace) -> int:
    if args.runtime != "docker":
        print(f"level=error msg=\"unrecognized runtime '{args.runtime}'\"", file=sys.stderr)
        return 1
    path = args.config
    config: dict[str, Any] = {}
    if os.path.exists(path) and os.path.getsize(path):
        with open(path) as f:
            config = json.load(f)
    else:
        print("INFO[0000] Config file does not exist; using empty config")
    config.setdefault("runtimes", {})[args.nvidia_runtime_name] = {"args": [], "path": "nvidia-container-runtime"}
    if args.set_as_default:
        config["default-runtime"] = args.nvidia_runtime_name
    if args.dry_run:
        print(json.dumps(config, indent=4, sort_keys=True))
        return 0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(config, indent=4, sort_keys=True))
    print(f"INFO[0000] Wrote updated config to {path}")
    print("INFO[0000] It is recommended that docker daemon be restarted.")
    return 0


def cdi_generate(args: argparse.Namespace) -> int:
    spec = json.dumps(
        {
            "cdiVersion": "0.5.0",
            "kind": "nvidia.com/gpu",
            "devices": [{"name": "all", "containerEdits": {}}],
            "containerEdits": {},
        },
        indent=2,
    )
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w") as f:
            f.write(spec + "\n")
        print("INFO[0000] Generated CDI spec with version 0.5.0")
    else:
        print(spec)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nvidia-ctk")
    parser.add_argument("--version", "-v", action="store_true")
    sub = parser.add_subparsers(dest="command")
    runtime = sub.add_parser("runtime").add_subparsers(dest="sub", required=True)
    cfg = runtime.add_parser("configure")
    cfg.add_argument("--runtime", default="docker")
    cfg.add_argument("--config", default="/etc/docker/daemon.json")
    cfg.add_argument("--nvidia-runtime-name", default="nvidia")
    cfg.add_argument("--set-as-default", action="store_true")
    cfg.add_argument("--dry-run", action="store_true")
    cdi = sub.add_parser("cdi").add_subparsers(dest="sub", required=True)
    gen = cdi.add_parser("generate")
    gen.add_argument("--output")
    system = sub.add_parser("system").add_subparsers(dest="sub", required=True)
    links = system.add_parser("create-dev-char-symlinks")
    links.add_argument("--create-all", action="store_true")
    args = parser.parse_args(argv)
    if args.version:
        print(f"NVIDIA Container Toolkit CLI version {VERSION}\ncommit: {COMMIT}")
        return 0
    if args.command == "runtime":
        return configure(args)
    if args.command == "cdi":
        return cdi_generate(args)
    if args.command == "system":
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
