"""The fleet's private L2: one bridge on the machine, one netns and veth per host, and no default route."""

from __future__ import annotations

from pathlib import Path

from gpufleet.sandbox.config import FleetConfig
from gpufleet.sandbox.procs import run
from gpufleet.sandbox.state import State


def link_exists(name: str) -> bool:
    return run(["ip", "link", "show", name], check=False).returncode == 0


def ensure_bridge(cfg: FleetConfig, state: State) -> None:
    if not link_exists(cfg.bridge):
        state.add("links", cfg.bridge)
        run(["ip", "link", "add", cfg.bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"{cfg.gateway}/24", "dev", cfg.bridge])
    run(["ip", "link", "set", cfg.bridge, "up"])


def add_host(cfg: FleetConfig, state: State, i: int, host: str) -> str:
    """Create the host's netns wired into the bridge; return the netns name."""
    ns, veth = cfg.netns(host), cfg.veth(i)
    remove_host(cfg, state, i, host)
    state.add("netns", ns)
    state.add("links", veth)
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
    run(["ip", "link", "set", veth, "master", cfg.bridge, "up"])
    run(["ip", "-n", ns, "addr", "add", f"{cfg.host_ip(i)}/24", "dev", "eth0"])
    run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    # /proc/sys is read-only inside, so set what dockerd needs from outside.
    run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    return ns


def remove_host(cfg: FleetConfig, state: State, i: int, host: str) -> None:
    ns, veth = cfg.netns(host), cfg.veth(i)
    if link_exists(veth):
        run(["ip", "link", "del", veth], check=False)
    if Path(f"/run/netns/{ns}").exists():
        run(["ip", "netns", "del", ns], check=False)
    state.discard("netns", ns)
    state.discard("links", veth)


def set_connected(cfg: FleetConfig, i: int, connected: bool) -> None:
    """Pull or plug back a host's cable."""
    run(["ip", "link", "set", cfg.veth(i), "up" if connected else "down"])


def remove_all(cfg: FleetConfig, state: State) -> None:
    """Delete every netns and link this fleet's state file names, then the bridge."""
    for ns in state.items("netns"):
        if Path(f"/run/netns/{ns}").exists():
            run(["ip", "netns", "del", ns], check=False)
        state.discard("netns", ns)
    for link in state.items("links"):
        if link != cfg.bridge and link_exists(link):
            run(["ip", "link", "del", link], check=False)
        state.discard("links", link)
    if link_exists(cfg.bridge):
        run(["ip", "link", "del", cfg.bridge], check=False)
    state.discard("links", cfg.bridge)
