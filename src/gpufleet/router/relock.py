"""Regenerate the lock of vllm-router's wheels (gpufleet.router.wheels; src/gpufleet/data/vllm-router-lock.json)
from PyPI's simple API, wheels only. Run it when bumping router_version:

    python -m gpufleet.router.relock                        # DEFAULTS' router_version, every Python and machine
    python -m gpufleet.router.relock --version 0.1.18 --version 0.1.17 --python 3.11 --python 3.13
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpufleet.router.settings import DEFAULTS
from gpufleet.router.wheels import INDEX_URL, LOCK_PATH, MACHINES, PYTHONS, REGENERATE, check, generate, write


def main(argv: list[str] | None = None) -> int:
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--version", action="append", help=f"router_version to lock (default {DEFAULTS['router_version']})"
    )
    parser.add_argument("--python", action="append", help=f"default: {', '.join(PYTHONS)} and this one ({here})")
    parser.add_argument("--machine", action="append", help=f"default: {', '.join(MACHINES)}")
    parser.add_argument("--index-url", default=INDEX_URL)
    parser.add_argument("--output", type=Path, default=LOCK_PATH)
    args = parser.parse_args(argv)
    pythons = args.python or sorted({*PYTHONS, here}, key=lambda v: tuple(map(int, v.split("."))))
    lock = generate(args.version or [DEFAULTS["router_version"]], pythons, args.machine or MACHINES, args.index_url)
    problems = check(lock)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    write(lock, args.output)
    for v, release in lock["releases"].items():
        for p, machines in release.items():
            for m, wheels in machines.items():
                print(f"vllm-router {v}, Python {p}, {m}: {len(wheels)} wheels")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
