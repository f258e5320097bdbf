"""The sandbox's package index for vllm-router: the real wheels from PyPI (vllm-router and its dependencies, for
the test hosts' Python), cached by version, laid out as a PEP 503 "simple" index the fleet's file server serves.

    python -m gpufleet.sandbox.router_index     # fetch into the cache (CI does this before the tests)
"""

from __future__ import annotations

import hashlib
import html
import re
import shutil
import sys
import time
from pathlib import Path

from gpufleet.router.settings import DEFAULTS
from gpufleet.sandbox import cache
from gpufleet.sandbox.config import CACHE_DIR
from gpufleet.sandbox.procs import log, run

VERSION = DEFAULTS["router_version"]
# The test hosts' Python (Debian bookworm's python3) and platform: wheels are fetched for them, not for this machine.
PYTHON = "3.11"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64")


def entry(cache_dir: Path, version: str = VERSION) -> Path:
    return cache_dir / f"router-index-{version}-py{PYTHON}"


def ensure_index(cache_dir: Path = CACHE_DIR, version: str = VERSION) -> Path:
    """The cached index root (serve it; pip's index URL is <root>/simple), fetched from PyPI on a cold cache."""
    root = entry(cache_dir, version)
    if cache.is_done(root):
        return root
    with cache.building(cache_dir / f".{root.name}.lock"):
        if cache.is_done(root):
            return root
        t0 = time.monotonic()
        tmp = cache_dir / f".{root.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        wheels = tmp / "files"
        wheels.mkdir(parents=True)
        log.info("fetching vllm-router %s and its dependencies for Python %s (once, cached as %s)", version, PYTHON, root)
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet", "--dest", str(wheels),
             "--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp", *platforms,
             f"vllm-router=={version}"], timeout=900)
        write_simple_index(wheels, tmp / "simple")
        log.info("router index built in %.0fs", cache.publish(tmp, root, t0))
    return root


def project_name(wheel: str) -> str:
    """PEP 503 normalised project name of a wheel file: "pydantic_core-2.1-....whl" -> "pydantic-core"."""
    return re.sub(r"[-_.]+", "-", wheel.split("-", 1)[0]).lower()


def write_simple_index(files: Path, simple: Path) -> None:
    """simple/index.html and simple/<project>/index.html linking ../../files/<wheel>#sha256=..."""
    projects: dict[str, list[Path]] = {}
    for wheel in sorted(files.glob("*.whl")):
        projects.setdefault(project_name(wheel.name), []).append(wheel)
    for name, wheels in projects.items():
        links = "".join(
            f'<a href="../../files/{html.escape(w.name)}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
            f"{html.escape(w.name)}</a>\n"
            for w in wheels
        )
        (simple / name).mkdir(parents=True, exist_ok=True)
        (simple / name / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    top = "".join(f'<a href="{n}/">{n}</a>\n' for n in sorted(projects))
    (simple / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{top}</body></html>\n")


if __name__ == "__main__":
    print(ensure_index())
