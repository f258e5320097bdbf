"""The base root filesystem (debootstrap, once) and the Debian mirror of what the deploy installs, cached by key."""

from __future__ import annotations

import hashlib
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from gpufleet.sandbox import cache
from gpufleet.sandbox.procs import log, run

SUITE = "bookworm"
# What every host has before any deploy: systemd as PID 1, sshd, sudo, and the tools the deploy's own steps call.
BASE_PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "sudo",
    "ca-certificates",
    "curl",
    "python3",
    "iproute2",
    "procps",
    "gnupg",
)
# What the deploys apt-install, served by the local mirror with their closure.
MIRROR_PACKAGES = (
    "docker.io",
    "gnupg",
    "curl",
    "ca-certificates",
    "jq",
    "python3-venv",
    "nginx",
    "libnginx-mod-http-js",
    "nftables",
    "docker-registry",
)
# Part of the cache key: bump when the customisation below changes.
RECIPE = "3"


@dataclass(frozen=True)
class Base:
    rootfs: Path  # read-only lower dir of every host overlay
    debs: Path  # flat Debian repo


def cache_key() -> str:
    inputs = "|".join([SUITE, "minbase", ",".join(BASE_PACKAGES), ",".join(MIRROR_PACKAGES), RECIPE])
    return hashlib.sha256(inputs.encode()).hexdigest()[:12]


def debian_mirror_url() -> str:
    """The machine's own Debian mirror, the only place outside the machine the sandbox fetches from."""
    for f in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        text = f.read_text() if f.is_file() else ""
        m = re.search(rf"^deb\s+(?:\[[^]]*\]\s+)?(http\S+)\s+{SUITE}\s+main", text, re.M)
        if m:
            return m.group(1)
        for stanza in text.split("\n\n"):
            if re.search(rf"^Suites:.*\b{SUITE}\b", stanza, re.M) and "/debian-security" not in stanza:
                m = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
                if m:
                    return m.group(1)
    return "http://deb.debian.org/debian"


def ensure_base(cache_dir: Path) -> Base:
    """The cached base, built first if its key is new."""
    root = cache_dir / f"base-{cache_key()}"
    base = Base(rootfs=root / "rootfs", debs=root / "debian")
    if cache.is_done(root):
        return base
    # Two sessions starting cold at once would build in, and delete, the same temp dir.
    with cache.building(cache_dir / f".base-{cache_key()}.lock"):
        if cache.is_done(root):
            return base
        t0 = time.monotonic()
        tmp = cache_dir / f".base-{cache_key()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        mirror = debian_mirror_url()
        log.info("debootstrap %s from %s (once, cached as %s)", SUITE, mirror, root)
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                SUITE,
                str(tmp / "rootfs"),
                mirror,
            ]
        )
        _customise(tmp / "rootfs")
        _download_debs(tmp / "rootfs", tmp / "debian", mirror)
        log.info("base rootfs built in %.0fs", cache.publish(tmp, root, t0))
    return base


def _customise(r: Path) -> None:
    # Host keys are generated per host: hosts sharing one would be one host to ssh.
    for key in (r / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    run(["chroot", str(r), "useradd", "-m", "-s", "/bin/bash", "-G", "sudo", "deploy"])
    sudoers = r / "etc/sudoers.d/deploy"
    sudoers.write_text("deploy ALL=(ALL) NOPASSWD:ALL\n")
    sudoers.chmod(0o440)
    # Nothing in a host should wait on DNS or a network it cannot reach.
    (r / "etc/ssh/sshd_config.d/gpufleet.conf").write_text(
        "HostKey /etc/ssh/ssh_host_ed25519_key\nUseDNS no\nMaxStartups 100:30:200\nMaxSessions 100\n"
    )
    for unit in ("apt-daily.timer", "apt-daily-upgrade.timer", "systemd-networkd-wait-online.service"):
        (r / "etc/systemd/system" / unit).unlink(missing_ok=True)
        (r / "etc/systemd/system" / unit).symlink_to("/dev/null")


def _download_debs(r: Path, out: Path, mirror: str) -> None:
    """Fetch the deploy's packages with the guest's own apt, so the closure matches, then index them."""
    shutil.copy("/etc/resolv.conf", r / "etc/resolv.conf")
    (r / "etc/apt/sources.list").write_text(f"deb {mirror} {SUITE} main\n")
    try:
        run(["chroot", str(r), "apt-get", "-q", "update"])
        # apt skips what is installed already, so list the closure explicitly and download all of it.
        closure = run(
            [
                "chroot",
                str(r),
                "apt-get",
                "-q",
                "-s",
                "-y",
                "--no-install-recommends",
                "-o",
                "Debug::NoLocking=1",
                "install",
                "--reinstall",
                *MIRROR_PACKAGES,
            ]
        ).stdout
        names = sorted(set(re.findall(r"^Inst (\S+)", closure, re.M)) | set(MIRROR_PACKAGES))
        out.mkdir(parents=True)
        run(["chroot", str(r), "sh", "-c", "cd /var/cache/apt/archives && apt-get -q download " + " ".join(names)])
        for deb in (r / "var/cache/apt/archives").glob("*.deb"):
            shutil.move(str(deb), out / deb.name)
    finally:
        run(["chroot", str(r), "apt-get", "clean"], check=False)
        for f in (r / "var/lib/apt/lists").glob("*"):
            if f.is_file():
                f.unlink()
        (r / "etc/resolv.conf").write_text("")
    packages = run(["dpkg-scanpackages", "-m", "."], cwd=out).stdout
    (out / "Packages").write_text(packages)
    run(["gzip", "-kf", "Packages"], cwd=out)
    (out / "Release").write_text(run(["apt-ftparchive", "release", "."], cwd=out).stdout)
