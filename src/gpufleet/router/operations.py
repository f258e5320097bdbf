"""pyinfra operations for a router host: arguments in (the spec, the host's RouterHost read), commands or
host.noop(why) out."""

from __future__ import annotations

import json
import shlex
from urllib.parse import quote

from pyinfra import host
from pyinfra.api import StringCommand, operation
from pyinfra.operations import apt

from gpufleet import hostlock
from gpufleet.operations.base import Commands
from gpufleet.operations.files import AtomicUpload, as_io, sha256
from gpufleet.router.facts import RouterHost
from gpufleet.router.spec import MEMBERS_DIR, RouterSpec
from gpufleet.router.unit import NGINX_DEFAULT_SITE, proxy_path, render_proxy, render_unit, unit_path


@operation()
def package(spec: RouterSpec, seen: RouterHost) -> Commands:
    """python3-venv, the venv, and exactly spec.version of vllm-router in it."""
    if seen.installed_version == spec.version and seen.venv_python:
        host.noop(f"vllm-router {spec.version} installed in {spec.venv}")
        return
    if not seen.venv_python:
        if not seen.python3_venv:
            yield from apt.packages._inner(packages=["python3-venv"], update=True, no_recommends=True)
        yield StringCommand("python3", "-m", "venv", shlex.quote(spec.venv))
    yield StringCommand(*map(shlex.quote, spec.pip_install_argv()))


@operation()
def unit(spec: RouterSpec, seen: RouterHost) -> Commands:
    """The router's systemd unit, replaced atomically when its content differs."""
    content = render_unit(spec)
    if seen.unit_sha256 == sha256(content):
        host.noop(f"{unit_path(spec.service)} is up to date")
        return
    yield AtomicUpload(as_io(content), unit_path(spec.service), "644")


def _router_snapshot_changes(spec: RouterSpec, seen: RouterHost) -> bool:
    """Does this run change what the router runs (its unit or its package)? Then it restarts."""
    return seen.unit_sha256 != sha256(render_unit(spec)) or seen.installed_version != spec.version


@operation()
def running(spec: RouterSpec, seen: RouterHost) -> Commands:
    """Enabled and running; restarted when its unit or its package changed (the router keeps no state worth a
    restart otherwise: its prefix trees rebuild from traffic)."""
    name = shlex.quote(f"{spec.service}.service")
    changed = _router_snapshot_changes(spec, seen)
    if not changed and seen.running and seen.enabled and not seen.need_daemon_reload:
        host.noop(f"{spec.service} running, enabled")
        return
    hostlock.check_run_lock(host)  # never restart it while another run may be changing it
    if changed or seen.need_daemon_reload:
        yield StringCommand("systemctl", "daemon-reload")
    if not seen.enabled:
        yield StringCommand("systemctl", "enable", name)
    yield StringCommand("systemctl", "restart" if changed or seen.running else "start", name)


@operation()
def ready(spec: RouterSpec, seen: RouterHost, timeout_s: int) -> Commands:
    """After a (re)start: wait until the router listens (/liveness: it listens at once, its workers come after)."""
    if not _router_snapshot_changes(spec, seen) and seen.running and seen.live_workers is not None:
        host.noop(f"{spec.service} answers on {spec.control_url}")
        return
    url = shlex.quote(f"{spec.control_url}/liveness")
    yield StringCommand("sh", "-c", shlex.quote(
        f"i=0; until curl -fsS --max-time 3 -o /dev/null {url}; do i=$((i+1)); "
        f"if [ $i -ge {timeout_s} ]; then echo 'the router did not answer /liveness within {timeout_s} s' >&2; "
        f"exit 1; fi; sleep 1; done"))


@operation()
def front_door(spec: RouterSpec, seen: RouterHost) -> Commands:
    """nginx on the client port, passing on the client API only (the router itself listens on the loopback):
    installed, its site written when it differs, Debian's default site disabled, checked, then reloaded."""
    content = render_proxy(spec)
    changed = seen.proxy_sha256 != sha256(content)
    if seen.nginx and not changed and not seen.default_site and seen.nginx_active:
        host.noop(f"nginx serves {spec.service}'s client API on port {spec.port}, and nothing else")
        return
    if not seen.nginx:
        yield from apt.packages._inner(packages=["nginx"], update=True, no_recommends=True)
    if changed:
        yield AtomicUpload(as_io(content), proxy_path(spec.service), "644")
    if seen.default_site or not seen.nginx:
        yield StringCommand("rm", "-f", NGINX_DEFAULT_SITE)
    # A site nginx refuses is not loaded: the running nginx keeps serving what it had.
    yield StringCommand("nginx", "-t", "-q")
    yield StringCommand("systemctl", "enable", "nginx")
    yield StringCommand("systemctl", "reload-or-restart", "nginx")


@operation()
def members(spec: RouterSpec, seen: RouterHost) -> Commands:
    """The members file the unit replays after a (re)start: this run's workers (the replicas that verify ready).
    Written before any restart, so a router restarted by this run comes back with exactly them."""
    content = spec.members_text()
    if seen.members_sha256 == sha256(content):
        host.noop(f"{spec.members_file} lists the {len(spec.workers)} workers")
        return
    if seen.members_sha256 is None:
        yield StringCommand("install", "-d", "-m", "755", shlex.quote(MEMBERS_DIR))
    yield AtomicUpload(as_io(content), spec.members_file, "644")


@operation()
def workers_in_step(spec: RouterSpec, seen: RouterHost) -> Commands:
    """The running router's worker set made this run's workers, through its own worker API: a worker left out (a
    cut rollout, a replica ready again) added, one not ready or no longer in the inventory removed. The router is
    never restarted for it. After a (re)start the unit adds the members back itself, in the background; here each
    is waited for (/add_worker returns once the worker answers /health)."""
    restarted = _router_snapshot_changes(spec, seen) or not seen.running or seen.live_workers is None
    live = set() if restarted else set(seen.live_workers or ())
    wanted = set(spec.workers)
    if not restarted and live == wanted:
        host.noop(f"the router routes to its {len(wanted)} workers")
        return
    listed = shlex.quote(f"{spec.control_url}/list_workers")
    for url in spec.workers:
        if url in live:
            continue
        add = shlex.quote(f"{spec.control_url}/add_worker?url={quote(url, safe='')}")
        # Listed already (the unit's own rejoin may have been first): nothing to add.
        yield StringCommand("sh", "-c", shlex.quote(
            f"curl -fsS --max-time 5 {listed} | grep -qF {shlex.quote(json.dumps(url))} || "
            f"curl -fsS -X POST --max-time {spec.worker_startup_timeout_s + 10} {add}"))
    for url in sorted(live - wanted):
        yield StringCommand("curl", "-fsS", "-X", "POST", "--max-time", "30",
                            shlex.quote(f"{spec.control_url}/remove_worker?url={quote(url, safe='')}"))
