"""One test host: an overlay over the read-only base rootfs, booted with systemd-nspawn --boot in its netns."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.sandbox import kernel_log, network, nvidia_smi, procs
from gpufleet.sandbox.config import FleetConfig, Gpus
from gpufleet.sandbox.procs import SandboxError, run
from gpufleet.sandbox.state import State


@dataclass(frozen=True)
class Host:
    name: str
    index: int  # 1-based; the address is .(10 + index)
    ip: str
    netns: str
    dir: Path  # the overlay's dirs, docker's and containerd's bind dirs, console.log
    gpus: Gpus
    role: str = "vllm"  # or "router"

    @property
    def root(self) -> Path:
        """The host's / as seen from the machine."""
        return self.dir / "merged"

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "dir": str(self.dir)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Host:
        return cls(**{**d, "dir": Path(d["dir"]), "gpus": Gpus(**d["gpus"])})


def make(cfg: FleetConfig, i: int, gpus: Gpus, role: str = "vllm") -> Host:
    name = cfg.host_name(i)
    return Host(
        name=name,
        index=i,
        ip=cfg.host_ip(i),
        netns=cfg.netns(name),
        dir=cfg.state_dir / "hosts" / name,
        gpus=gpus,
        role=role,
    )


def ssh_argv(host: Host, key: Path, *command: str, user: str = "deploy") -> list[str]:
    return [
        "ssh",
        "-i",
        str(key),
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        "-o",
        "ConnectTimeout=2",
        "-o",
        "BatchMode=yes",
        f"{user}@{host.ip}",
        *command,
    ]


def create(cfg: FleetConfig, state: State, host: Host, base_rootfs: Path, key: Path) -> None:
    """Fresh overlay with everything host-specific written into its upper dir, and the host's netns."""
    destroy(cfg, state, host)
    for d in ("upper", "work", "merged", "docker", "containerd"):
        (host.dir / d).mkdir(parents=True, exist_ok=True)
    state.add("mounts", str(host.root))
    run(
        [
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"lowerdir={base_rootfs},upperdir={host.dir / 'upper'},workdir={host.dir / 'work'}",
            str(host.root),
        ]
    )
    _personalise(cfg, host, key)
    network.add_host(cfg, state, host.index, host.name)


def _personalise(cfg: FleetConfig, host: Host, key: Path) -> None:
    r = host.root
    (r / "etc/hostname").write_text(host.name + "\n")
    # Without 127.0.1.1 <hostname> every sudo waits on DNS.
    (r / "etc/hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{host.name}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    (r / "etc/resolv.conf").write_text("")  # no lookup ever leaves the machine
    (r / "etc/machine-id").write_text(secrets.token_hex(16) + "\n")
    (r / "var/log/journal").mkdir(parents=True, exist_ok=True)  # persistent, so the machine can read it
    # Old, empty apt lists, which the deploy's cache_valid_time must refresh.
    os.utime(r / "var/lib/apt/lists", (946684800, 946684800))
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.name, "-f", str(r / "etc/ssh/ssh_host_ed25519_key")])
    (r / "etc/apt/sources.list").write_text(f"deb [trusted=yes] {cfg.mirror_url}/debian ./\n")
    ssh_dir = r / "home/deploy/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    shutil.copy(key.with_suffix(".pub"), ssh_dir / "authorized_keys")
    (ssh_dir / "authorized_keys").chmod(0o600)
    for p in (ssh_dir, ssh_dir / "authorized_keys"):
        os.chown(p, 1000, 1000)
    # Test setup for the plain-HTTP registry; the deploy must merge into this file.
    (r / "etc/docker").mkdir(parents=True, exist_ok=True)
    (r / "etc/docker/daemon.json").write_text(json.dumps({"insecure-registries": [cfg.registry]}, indent=2) + "\n")
    profile = host.gpus.profile(seed=host.name)
    nvidia_smi.write_host_files(r, profile)
    if profile is not None:
        kernel_log.install(r)


def boot(state: State, host: Host) -> int:
    propagate = Path("/run/systemd/nspawn/propagate") / host.name
    shutil.rmtree(propagate, ignore_errors=True)
    env = {
        **os.environ,
        # Without it dockerd inside starts but `docker run` fails on a read-only cgroup v1 cpuset.
        "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1",
    }
    argv = [
        "systemd-nspawn",
        "-q",
        "-D",
        str(host.root),
        "-M",
        host.name,
        "--boot",
        # the machine's PID 1 is not systemd
        "--register=no",
        "--keep-unit",
        f"--network-namespace-path=/run/netns/{host.netns}",
        "--console=read-only",
        "--capability=all",
        "--system-call-filter=@keyring bpf",
        "--resolv-conf=off",
        "--link-journal=no",
        "--timezone=off",
        # overlay-on-overlay fails, so their storage must be real directories
        f"--bind={host.dir / 'docker'}:/var/lib/docker",
        f"--bind={host.dir / 'containerd'}:/var/lib/containerd",
    ]
    pid = procs.spawn(argv, host.dir / "console.log", env=env)
    state.add_pid(f"host:{host.name}", pid)
    return pid


def wait_ready(host: Host, key: Path, pid: int, timeout: float = 120) -> str:
    """Block until systemd in the host reports running or degraded over SSH."""

    def answer() -> str | None:
        if not procs.alive(pid):
            tail = (host.dir / "console.log").read_text(errors="replace")[-300:]
            raise SandboxError(f"{host.name}: systemd-nspawn exited during boot: {tail!r}")
        try:
            # Bound each --wait, so a stuck boot surfaces as our timeout.
            out = subprocess.run(
                ssh_argv(host, key, "systemctl", "is-system-running", "--wait"),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=20,
            )
        except subprocess.TimeoutExpired:
            return None
        return out.stdout.strip() if out.stdout.strip() in ("running", "degraded") else None

    return procs.wait_for(answer, timeout, f"{host.name} to boot", interval=0.2)


def shutdown(state: State, host: Host, grace: float = 30.0) -> None:
    entry = state.pid(f"host:{host.name}")
    if entry:
        procs.stop(entry[0], grace=grace, started=entry[1])
    state.drop_pid(f"host:{host.name}")


def destroy(cfg: FleetConfig, state: State, host: Host) -> None:
    # The disk is thrown away and systemd inside may ignore the first SIGTERM, so wait less than a reboot does.
    shutdown(state, host, grace=10.0)
    unmount_below(host.dir)
    state.discard("mounts", str(host.root))
    network.remove_host(cfg, state, host.index, host.name)
    shutil.rmtree(Path("/run/systemd/nspawn/propagate") / host.name, ignore_errors=True)
    shutil.rmtree(host.dir, ignore_errors=True)


def unmount_below(path: Path) -> None:
    """Unmount everything mounted at or below path, deepest first."""
    prefix = str(path)
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for m in sorted((m for m in mounts if m == prefix or m.startswith(prefix + "/")), key=len, reverse=True):
        run(["umount", "-l", m], check=False)


# ------------------------------------------------------------------------------------------ helpers for tests
def leader_pid(state: State, host: Host) -> int:
    """The host's PID 1, the only child of its systemd-nspawn."""
    nspawn = state.live_pid(f"host:{host.name}")
    if not nspawn:
        raise SandboxError(f"{host.name} is not running")
    kids = run(["ps", "-o", "pid=", "--ppid", str(nspawn)]).stdout.split()
    return int(kids[0])


def run_in(
    state: State, host: Host, command: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a shell command as root inside the host, without SSH."""
    argv = [
        "nsenter",
        "-t",
        str(leader_pid(state, host)),
        "-m",
        "-u",
        "-i",
        "-n",
        "-p",
        "-C",
        "--",
        "/bin/sh",
        "-c",
        command,
    ]
    return run(argv, check=check, timeout=timeout)


def read_file(host: Host, path: str) -> bytes:
    """A file of the host's filesystem, read without SSH."""
    rel = path.lstrip("/")
    for mount, sub in (("var/lib/docker", "docker"), ("var/lib/containerd", "containerd")):
        if rel == mount or rel.startswith(mount + "/"):
            return (host.dir / sub / rel[len(mount) :].lstrip("/")).read_bytes()
    return (host.root / rel).read_bytes()


def restart(state: State, host: Host, key: Path) -> float:
    """Stop the host's container and boot it again on the same overlay."""
    t0 = time.monotonic()
    shutdown(state, host)
    pid = boot(state, host)
    wait_ready(host, key, pid)
    return time.monotonic() - t0
