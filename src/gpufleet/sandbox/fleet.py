"""A fleet of test hosts and its services: start, add hosts (in parallel), stop, and clear a killed run's leftovers.

fleet = Fleet(sandbox_config())
fleet.start()                       # base rootfs, bridge, mirror, NVIDIA + Docker repos, registry, images
hosts = fleet.add_hosts([H200x3, NO_GPU])
fleet.stop()                        # nothing of ours left: processes, mounts, netns, links, bridge
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpufleet.sandbox import docker_repo, image, network, nvidia_repo, procs, rootfs, router_index, services
from gpufleet.sandbox import hosts as hostmod
from gpufleet.sandbox.config import FleetConfig, Gpus
from gpufleet.sandbox.hosts import Host
from gpufleet.sandbox.procs import SandboxError, log, run
from gpufleet.sandbox.state import State

BOOT_TIMEOUT_S = 60.0  # a hang detector: a boot takes about a second

# machine tool -> Debian package that provides it
TOOLS = {
    "systemd-nspawn": "systemd-container",
    "debootstrap": "debootstrap",
    "docker-registry": "docker-registry",
    "dockerd": "docker.io",
    "dpkg-scanpackages": "dpkg-dev",
    "apt-ftparchive": "apt-utils",
    "gpg": "gnupg",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "iptables-save": "iptables",
    "nsenter": "util-linux",
}


def check_prerequisites() -> None:
    """Raise SandboxError (one line) unless this machine can run a fleet: root, and every tool installed."""
    if os.geteuid() != 0:
        raise SandboxError("the sandbox needs root (it creates network namespaces, mounts and containers)")
    missing = sorted({pkg for tool, pkg in TOOLS.items() if not shutil.which(tool)})
    if missing:
        raise SandboxError(f"missing tools; install them with: apt-get install {' '.join(missing)}")


class Fleet:
    def __init__(self, cfg: FleetConfig):
        self.cfg = cfg
        self.state = State(cfg.state_dir / "state.json")
        self.key = cfg.state_dir / "ssh" / "id_ed25519"
        self.timings: dict[str, float] = {}
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------------------------------------- start
    def lock(self, timeout: float = 1800) -> None:
        """Hold the fleet's lock until stop() or this process's death, waiting for another live run (docs/test-hosts.md)."""
        if self._lock_fd is not None:
            return
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.cfg.state_dir / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise SandboxError(f"fleet {self.cfg.name} is in use by another run for {timeout:.0f}s") from None
                if not waited:
                    log.info("fleet %s is in use by another run: waiting for it", self.cfg.name)
                    waited = True
                time.sleep(1)
        self._lock_fd = fd
        self.state = State(self.cfg.state_dir / "state.json")

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def start(self) -> None:
        """Clear leftovers of an earlier run of this fleet, then bring up the shared parts."""
        check_prerequisites()
        self.lock()
        self.clear_leftovers()
        cfg = self.cfg
        cfg.state_dir.chmod(0o700)  # holds the fleet's private SSH key
        t0 = time.monotonic()
        base = rootfs.ensure_base(cfg.cache_dir)
        self.timings["base"] = time.monotonic() - t0
        self.base_rootfs = base.rootfs
        self.state.set("base_rootfs", str(base.rootfs))
        if not self.key.exists():
            self.key.parent.mkdir(parents=True, exist_ok=True)
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gpufleet-{cfg.name}", "-f", str(self.key)])
        network.ensure_bridge(cfg, self.state)
        repo = nvidia_repo.ensure_repo(cfg.cache_dir, cfg.nvidia_repo_url)
        t0 = time.monotonic()
        docker = docker_repo.ensure_repo(cfg.cache_dir, base.debs)
        self.timings["docker_repo"] = time.monotonic() - t0
        pypi = router_index.ensure_index(cfg.cache_dir)
        olah = router_index.ensure_mirror_index(cfg.cache_dir)
        services.serve_files(
            cfg, self.state, {"debian": base.debs, "nvidia": repo, "docker": docker, "pypi": pypi, "pypi-mirror": olah}
        )
        services.serve_registry(cfg, self.state)
        tiny = cfg.state_dir / "tiny-model"
        image.write_tiny_model(tiny)
        services.serve_hub(cfg, self.state, tiny, image.MODEL_REPO)
        t0 = time.monotonic()
        image.ensure_images(cfg, self.state, base.rootfs)
        self.timings["images"] = time.monotonic() - t0

    # ------------------------------------------------------------------------------------------------- hosts
    def hosts(self) -> list[Host]:
        return [Host.from_dict(h) for h in self.state.get("hosts", [])]

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts() if h.name == name)

    def add_hosts(self, gpus: list[Gpus], first: int | None = None, role: str = "vllm") -> list[Host]:
        """Create and boot len(gpus) hosts in parallel, numbered from `first` (default: after the last one)."""
        start = first or 1 + max((h.index for h in self.hosts()), default=0)
        new = [hostmod.make(self.cfg, start + i, g, role) for i, g in enumerate(gpus)]
        base = Path(self.state.get("base_rootfs"))
        t0 = time.monotonic()

        def bring_up(h: Host) -> Host:
            hostmod.create(self.cfg, self.state, h, base, self.key)
            pid = hostmod.boot(self.state, h)
            try:
                # Now and then a boot hangs under load: record what it was stuck on, then rebuild the host once.
                hostmod.wait_ready(h, self.key, pid, timeout=BOOT_TIMEOUT_S)
            except SandboxError as error:
                log.warning("%s: %s; retrying once. Diagnostics:\n%s", h.name, error, self._boot_diagnostics(h))
                hostmod.destroy(self.cfg, self.state, h)
                hostmod.create(self.cfg, self.state, h, base, self.key)
                hostmod.wait_ready(h, self.key, hostmod.boot(self.state, h), timeout=2 * BOOT_TIMEOUT_S)
            return h

        with ThreadPoolExecutor(max_workers=max(1, len(new))) as pool:
            up = list(pool.map(bring_up, new))
        self.timings[f"boot_{len(new)}"] = time.monotonic() - t0
        log.info("booted %d host(s) in %.1fs", len(new), self.timings[f"boot_{len(new)}"])
        others = [h for h in self.hosts() if h.name not in {n.name for n in up}]
        self.state.set("hosts", [h.as_dict() for h in sorted([*others, *up], key=lambda h: h.index)])
        return up

    def _boot_diagnostics(self, h: Host) -> str:
        console = (
            (h.dir / "console.log").read_text(errors="replace")[-1500:] if (h.dir / "console.log").exists() else ""
        )
        try:
            jobs = hostmod.run_in(
                self.state, h, "systemctl list-jobs --no-pager; systemctl --failed --no-pager", check=False, timeout=15
            ).stdout
        except Exception as error:  # never mask the boot failure itself
            jobs = f"(could not enter the host: {error})"
        return f"console tail:\n{console}\nsystemd jobs:\n{jobs}"

    def remove_hosts(self, names: list[str] | None = None) -> None:
        """Stop and delete hosts (all by default), in parallel."""
        doomed = [h for h in self.hosts() if names is None or h.name in names]
        with ThreadPoolExecutor(max_workers=max(1, len(doomed))) as pool:
            list(pool.map(lambda h: hostmod.destroy(self.cfg, self.state, h), doomed))
        self.state.set("hosts", [h.as_dict() for h in self.hosts() if h not in doomed])

    # -------------------------------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Undo everything this fleet created, then release it; caches stay."""
        self.lock()
        try:
            self.remove_hosts()
            self.clear_leftovers()
        finally:
            self.unlock()

    def clear_leftovers(self) -> None:
        """Remove what an earlier run of THIS fleet left, by its state file and its own naming scheme only."""
        cfg, state = self.cfg, self.state
        for name in list(state.get("pids", {})):
            if entry := state.pid(name):
                procs.stop(entry[0], grace=30 if name.startswith("host:") else 10, started=entry[1])
            state.drop_pid(name)
        hostmod.unmount_below(cfg.state_dir / "hosts")
        image.remove_dockerd_dirs(cfg)
        for m in state.items("mounts"):
            state.discard("mounts", m)
        for ns in run(["ip", "netns", "list"], check=False).stdout.split("\n"):
            ns = ns.split(" ")[0]
            if ns.startswith(f"gf-{cfg.name}-"):
                state.add("netns", ns)
        for line in run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
            link = line.split(": ")[1].split("@")[0]
            if link.startswith(f"{cfg.bridge}-"):
                state.add("links", link)
        network.remove_all(cfg, state)
        for h in self.hosts():
            shutil.rmtree(Path("/run/systemd/nspawn/propagate") / h.name, ignore_errors=True)
        shutil.rmtree(cfg.state_dir / "hosts", ignore_errors=True)
        state.set("hosts", [])
        (cfg.state_dir / "inventory.json").unlink(missing_ok=True)

    # ----------------------------------------------------------------------------------------------- helpers
    def run_in(self, host: Host | str, command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return hostmod.run_in(self.state, self._h(host), command, check=check)

    def ssh(self, host: Host | str, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(hostmod.ssh_argv(self._h(host), self.key, *command), check=check, timeout=300)

    def read_file(self, host: Host | str, path: str) -> bytes:
        return hostmod.read_file(self._h(host), path)

    def reboot(self, host: Host | str) -> float:
        return hostmod.restart(self.state, self._h(host), self.key)

    def set_connected(self, host: Host | str, connected: bool) -> None:
        network.set_connected(self.cfg, self._h(host).index, connected)

    def _h(self, host: Host | str) -> Host:
        return self.host(host) if isinstance(host, str) else host

    def write_inventory(self, site_cache: tuple[str, ...] = ()) -> Path:
        """Write <state dir>/inventory.json, which the sandbox and test inventories turn into hosts."""
        from gpufleet.sandbox.inventory import inventory_document

        path = self.cfg.state_dir / "inventory.json"
        doc = inventory_document(self.cfg, self.hosts(), self.key, site_cache=site_cache)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        return path
