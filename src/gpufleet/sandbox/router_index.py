"""The sandbox's PEP 503 indexes for vllm-router and olah: exactly the wheels their locks name, hash-checked.

python -m gpufleet.sandbox.router_index     # fetch both into the cache
"""

from __future__ import annotations

import hashlib
import html
import platform
import re
import shutil
import sys
import time
from pathlib import Path

from gpufleet import wheel_lock
from gpufleet.router import wheels
from gpufleet.router.settings import DEFAULTS
from gpufleet.sandbox import cache
from gpufleet.sandbox.config import CACHE_DIR
from gpufleet.sandbox.procs import log, run
from gpufleet.sitecache import mirror

VERSION = DEFAULTS["router_version"]
# Wheels are fetched for the test hosts' Python, not this machine's.
PYTHON = "3.11"
MACHINE = platform.machine()


def locked(version: str = VERSION) -> wheels.LockedInstall:
    return wheels.locked_install("sandbox", version, PYTHON, MACHINE)


def entry(cache_dir: Path, version: str = VERSION) -> Path:
    return cache_dir / f"router-index-{version}-py{PYTHON}-{locked(version).key[:12]}"


def ensure_index(cache_dir: Path = CACHE_DIR, version: str = VERSION) -> Path:
    """The router's cached index root; pip's index URL is <root>/simple."""
    return ensure_lock_index(entry(cache_dir, version), locked(version))


def ensure_mirror_index(cache_dir: Path = CACHE_DIR) -> Path:
    """The model mirror's cached index root."""
    install = mirror.locked("sandbox", PYTHON, MACHINE)
    return ensure_lock_index(cache_dir / f"mirror-index-{mirror.OLAH_VERSION}-py{PYTHON}-{install.key[:12]}", install)


def ensure_lock_index(root: Path, install: wheel_lock.LockedInstall) -> Path:
    """The index at `root`, fetched on a cold cache and checked against the lock."""
    cache_dir = root.parent
    if cache.is_done(root):
        return root
    with cache.building(cache_dir / f".{root.name}.lock"):
        if cache.is_done(root):
            return root
        t0 = time.monotonic()
        tmp = cache_dir / f".{root.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        downloads = tmp / "files"
        downloads.mkdir(parents=True)
        requirements = tmp / "requirements.txt"
        requirements.write_text(install.requirements())
        log.info(
            "fetching the %d locked wheels of %s (once, cached as %s)", len(install.wheels), install.describe(), root
        )
        platforms = [arg for p in wheels.platforms(MACHINE) for arg in ("--platform", p)]
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--disable-pip-version-check",
                "--quiet",
                "--dest",
                str(downloads),
                "--require-hashes",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                PYTHON,
                "--implementation",
                "cp",
                *platforms,
                "-r",
                str(requirements),
            ],
            timeout=900,
        )
        check_files(downloads, install)
        write_simple_index(downloads, tmp / "simple")
        log.info("%s index built in %.0fs", install.package, cache.publish(tmp, root, t0))
    return root


def check_files(files: Path, install: wheel_lock.LockedInstall) -> None:
    """The directory holds exactly the lock's wheels, each with the lock's sha256; raises otherwise."""
    want = {w.filename: w.sha256 for w in install.wheels}
    have = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files.iterdir()}
    if have != want:
        wrong = sorted(set(have.items()) ^ set(want.items()))
        raise RuntimeError(f"the {install.package} index does not hold exactly the locked wheels: {wrong[:4]}")


def project_name(wheel: str) -> str:
    """PEP 503 normalised project name of a wheel file."""
    return re.sub(r"[-_.]+", "-", wheel.split("-", 1)[0]).lower()


def write_simple_index(files: Path, simple: Path) -> None:
    """simple/index.html and simple/<project>/index.html linking ../../files/<wheel>#sha256=..."""
    projects: dict[str, list[Path]] = {}
    for wheel in sorted(files.glob("*.whl")):
        projects.setdefault(project_name(wheel.name), []).append(wheel)
    for name, project_wheels in projects.items():
        links = "".join(
            f'<a href="../../files/{html.escape(w.name)}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
            f"{html.escape(w.name)}</a>\n"
            for w in project_wheels
        )
        (simple / name).mkdir(parents=True, exist_ok=True)
        (simple / name / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    top = "".join(f'<a href="{n}/">{n}</a>\n' for n in sorted(projects))
    (simple / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{top}</body></html>\n")


if __name__ == "__main__":
    print(ensure_index())
    print(ensure_mirror_index())
