"""Stand-in of NVIDIA's container-toolkit apt repo, with the real URL layout and a signed InRelease.

Its .list names the base URL, so the repo is cached per base.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path

from gpufleet.sandbox import cache
from gpufleet.sandbox.apt_signing import ThrowawayKey
from gpufleet.sandbox.procs import log, run

PACKAGE = "nvidia-container-toolkit"
VERSION = "1.17.8-1"
STANDIN = Path(__file__).parent / "standin"
# installed name -> stand-in source file
EXECUTABLES = {
    "nvidia-ctk": "nvidia_ctk.py",
    "nvidia-container-runtime": "nvidia_container_runtime.py",
    "nvidia-container-runtime-hook": "nvidia_container_runtime_hook.py",
}
KEYRING = "/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg"


def _key(base_url: str) -> str:
    h = hashlib.sha256(base_url.encode())
    for src in sorted(EXECUTABLES.values()):
        h.update((STANDIN / src).read_bytes())
    h.update(Path(__file__).read_bytes())
    h.update((Path(__file__).parent / "apt_signing.py").read_bytes())
    return h.hexdigest()[:12]


def ensure_repo(cache_dir: Path, base_url: str) -> Path:
    """The repo root to serve at base_url, built once per base URL and stand-in source."""
    root = cache_dir / f"nvidia-repo-{_key(base_url)}"
    if cache.is_done(root):
        return root
    # Two fleets on one base URL starting at once must not build in the same tmp dir.
    with cache.building(cache_dir / f".{root.name}.lock"):
        if not cache.is_done(root):
            _build_repo(root, base_url)
    return root


def _build_repo(root: Path, base_url: str) -> None:
    t0 = time.monotonic()
    log.info("building the stand-in NVIDIA repo for %s", base_url)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    arch = tmp / "stable/deb/amd64"
    arch.mkdir(parents=True)
    (tmp / "stable/deb/nvidia-container-toolkit.list").write_text(
        f"deb [signed-by={KEYRING}] {base_url}/stable/deb/$(ARCH) /\n"
        f"#deb [signed-by={KEYRING}] {base_url}/experimental/deb/$(ARCH) /\n"
    )
    _build_deb(tmp / "pkg", arch / f"{PACKAGE}_{VERSION}_amd64.deb")
    run(["sh", "-c", "apt-ftparchive packages . > Packages && gzip -kf Packages"], cwd=arch)
    release = run(
        [
            "apt-ftparchive",
            "-o",
            "APT::FTPArchive::Release::Origin=https://nvidia.github.io/libnvidia-container/stable/deb/amd64",
            "-o",
            "APT::FTPArchive::Release::Label=NVIDIA CUDA",
            "release",
            ".",
        ],
        cwd=arch,
    ).stdout
    (arch / "Release").write_text(release)
    # The private key stays out of the served tree.
    with ThrowawayKey(
        root.with_name(root.name + ".gnupg"),
        "NVIDIA repo stand-in (throwaway, gpufleet sandbox) <sandbox@gpufleet.invalid>",
    ) as key:
        (tmp / "gpgkey").write_text(key.armored_public_key())
        key.sign_release(arch)
    shutil.rmtree(tmp / "pkg")
    cache.publish(tmp, root, t0)


def _build_deb(pkg: Path, out: Path) -> None:
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "usr/bin").mkdir(parents=True)
    (pkg / "DEBIAN/control").write_text(
        f"Package: {PACKAGE}\nVersion: {VERSION}\nArchitecture: amd64\n"
        "Maintainer: gpufleet sandbox <sandbox@gpufleet.invalid>\nDepends: python3\n"
        "Description: NVIDIA container runtime hook (gpufleet sandbox stand-in)\n"
        " Stand-in of nvidia-ctk, nvidia-container-runtime and nvidia-container-runtime-hook for test hosts.\n"
    )
    for name, src in EXECUTABLES.items():
        shutil.copy(STANDIN / src, pkg / "usr/bin" / name)
        (pkg / "usr/bin" / name).chmod(0o755)
    run(["dpkg-deb", "-Zgzip", "--root-owner-group", "--build", str(pkg), str(out)])
