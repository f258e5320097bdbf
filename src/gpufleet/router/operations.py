"""pyinfra operations for a router host; docs/router.md (The deploy) explains the venv switch and the fence."""

from __future__ import annotations

import json
import shlex
from urllib.parse import quote

from pyinfra import host
from pyinfra.api import FunctionCommand, Host, StringCommand, operation
from pyinfra.operations import apt

from gpufleet.operations.base import Commands
from gpufleet.operations.files import AtomicUpload, as_io, sha256
from gpufleet.operations.run import still_locked, while_held
from gpufleet.router.facts import RouterHost
from gpufleet.router.spec import FENCE_USERS, MARKER, MEMBERS_DIR, RouterSpec
from gpufleet.router.unit import (
    NGINX_DEFAULT_CONFIG,
    NGINX_SCRIPTS,
    NJS_PACKAGE,
    proxy_path,
    render_proxy,
    render_session_script,
    render_unit,
    session_key,
    unit_path,
)
from gpufleet.router.wheels import LockedInstall

REQUIREMENTS = "gpufleet-requirements.txt"  # in each locked venv


def install_script(spec: RouterSpec, install: LockedInstall) -> str:
    """Shell: the lock's wheels into their own venv, then the marker that says it is whole."""
    target = spec.venv_dir(install.key)
    pip = " ".join(map(shlex.quote, spec.pip_install_argv(target, f"{target}/{REQUIREMENTS}")))
    marker = shlex.quote(f"{target}/{MARKER}")
    return (
        f"{pip} && {shlex.quote(target)}/bin/vllm-router --help >/dev/null && "
        f"printf '%s\\n' {install.key} > {marker}.tmp && sync {marker}.tmp && mv -f {marker}.tmp {marker}"
    )


def switch_script(spec: RouterSpec, install: LockedInstall) -> str:
    """Shell: router_venv pointed at the locked venv by one rename, the old target kept as `previous`."""
    venv, venvs, target = (shlex.quote(p) for p in (spec.venv, spec.venvs_dir, spec.venv_dir(install.key)))
    return (
        f"old=$(readlink {venv} || true); ln -sfn {target} {venv}.gpufleet-tmp && "
        f"{{ test -L {venv} || ! test -d {venv} || {{ rm -rf {venvs}/legacy && mv -T {venv} {venvs}/legacy; }}; }} && "
        f"mv -T {venv}.gpufleet-tmp {venv} && sync {shlex.quote(spec.venv.rpartition('/')[0] or '/')} && "
        f'if [ -n "$old" ] && [ "$old" != {target} ]; then ln -sfn "$old" {venvs}/previous.tmp && '
        f"mv -T {venvs}/previous.tmp {venvs}/previous; fi"
    )


@operation()
def package(spec: RouterSpec, seen: RouterHost, install: LockedInstall) -> Commands:
    """The lock's wheels in a venv of their own, switched in; a whole venv is not installed again."""
    target = spec.venv_dir(install.key)
    if seen.venv_key == install.key and seen.venv_link == target:
        host.noop(f"{install.describe()} installed in {spec.venv}")
        return
    if seen.venvs.get(target.rpartition("/")[2]) != install.key:
        if not seen.python3_venv:
            yield from apt.packages._inner(packages=["python3-venv"], update=True, no_recommends=True)
        # A venv left by a cut install is made again from nothing.
        yield StringCommand(
            "sh",
            "-c",
            shlex.quote(
                f"install -d -m 755 {shlex.quote(spec.venvs_dir)} && rm -rf {shlex.quote(target)} && "
                f"python3 -m venv {shlex.quote(target)}"
            ),
        )
        yield AtomicUpload(as_io(install.requirements()), f"{target}/{REQUIREMENTS}", "644")
        yield StringCommand("sh", "-c", shlex.quote(install_script(spec, install)))
    yield StringCommand("sh", "-c", shlex.quote(switch_script(spec, install)))


@operation()
def old_venvs(spec: RouterSpec, seen: RouterHost, install: LockedInstall) -> Commands:
    """Every venv but the one in use and the previous one removed."""
    keep = {spec.venv_dir(install.key).rpartition("/")[2]}
    if seen.venv_key == install.key and seen.venv_previous:
        keep.add(seen.venv_previous.rstrip("/").rpartition("/")[2])
    elif seen.venv_link and seen.venv_link != spec.venv_dir(install.key):
        keep.add(seen.venv_link.rstrip("/").rpartition("/")[2])  # now `previous`
    # This run's switch moved a venv from before the lock to <venvs>/legacy.
    stale = sorted((set(seen.venvs) | ({"legacy"} if seen.venv_legacy else set())) - keep)
    if not stale:
        host.noop(f"no old venv beside {spec.venv}")
        return
    yield StringCommand("rm", "-rf", *(shlex.quote(f"{spec.venvs_dir}/{name}") for name in stale))


@operation()
def unit(spec: RouterSpec, seen: RouterHost) -> Commands:
    """The router's systemd unit, replaced atomically when its content differs."""
    content = render_unit(spec)
    if seen.unit_sha256 == sha256(content):
        host.noop(f"{unit_path(spec.service)} is up to date")
        return
    yield AtomicUpload(as_io(content), unit_path(spec.service), "644")


@operation()
def fence(spec: RouterSpec, seen: RouterHost, install: LockedInstall) -> Commands:
    """nftables for the unit's fence, loaded now under a router that runs without it."""
    if not seen.nftables:
        yield StringCommand("apt-get", "update", "-q")
        yield StringCommand(
            "DEBIAN_FRONTEND=noninteractive", "apt-get", "install", "-y", "-q", "--no-install-recommends", "nftables"
        )
    restarts = _router_snapshot_changes(spec, seen, install) or not seen.running
    if seen.nftables and (seen.fenced or restarts):
        host.noop(
            f"{spec.service}'s port {spec.internal_port} is fenced to {', '.join(FENCE_USERS)}"
            + (" at its start" if restarts else "")
        )
        return
    if not restarts:
        yield StringCommand(*(shlex.quote(a) for a in spec.fence_argv()))


def _router_snapshot_changes(spec: RouterSpec, seen: RouterHost, install: LockedInstall) -> bool:
    """Does this run change the router's unit or venv?"""
    return seen.unit_sha256 != sha256(render_unit(spec)) or seen.venv_key != install.key


@operation()
def running(spec: RouterSpec, seen: RouterHost, install: LockedInstall) -> Commands:
    """Enabled and running; restarted when its unit or venv changed, only under this run's lock."""
    name = shlex.quote(f"{spec.service}.service")
    changed = _router_snapshot_changes(spec, seen, install)
    if not changed and seen.running and seen.enabled and not seen.need_daemon_reload:
        host.noop(f"{spec.service} running, enabled")
        return
    yield FunctionCommand(still_locked, (), {})
    if changed or seen.need_daemon_reload:
        yield StringCommand("systemctl", "daemon-reload")
    if not seen.enabled:
        yield StringCommand("systemctl", "enable", name)
    yield StringCommand("sh", "-c", shlex.quote(restart_script(host, name, changed or seen.running)))


def restart_script(target: Host, name: str, restart: bool) -> str:
    """Shell: (re)start `name` only while this run holds the host's lock."""
    return while_held(
        target,
        f"systemctl {'restart' if restart else 'start'} {name}",
        f"{target.name}: not restarting {name}: this run no longer holds the host's lock (fix: run again)",
    )


@operation()
def ready(spec: RouterSpec, seen: RouterHost, install: LockedInstall, timeout_s: int) -> Commands:
    """After a (re)start, wait for /liveness."""
    if not _router_snapshot_changes(spec, seen, install) and seen.running and seen.live_workers is not None:
        host.noop(f"{spec.service} answers on {spec.control_url}")
        return
    url = shlex.quote(f"{spec.control_url}/liveness")
    yield StringCommand(
        "sh",
        "-c",
        shlex.quote(
            f"i=0; until curl -fsS --max-time 3 -o /dev/null {url}; do i=$((i+1)); "
            f"if [ $i -ge {timeout_s} ]; then echo 'the router did not answer /liveness within {timeout_s} s' >&2; "
            f"exit 1; fi; sleep 1; done"
        ),
    )


@operation()
def front_door(spec: RouterSpec, seen: RouterHost) -> Commands:
    """nginx on the client port, passing on the client API only and keying sessions where the policy needs it."""
    content = render_proxy(spec)
    changed = seen.proxy_sha256 != sha256(content)
    key = session_key(spec)
    script = render_session_script() if key else ""
    script_changed = key is not None and seen.session_script_sha256 != sha256(script)
    njs_missing = key is not None and not seen.njs
    if (
        seen.nginx
        and not changed
        and not script_changed
        and not njs_missing
        and not seen.default_config
        and seen.nginx_active
    ):
        host.noop(f"nginx serves {spec.service}'s client API on port {spec.port}, and nothing else")
        return
    if not seen.nginx or njs_missing:
        yield from apt.packages._inner(
            packages=["nginx", *([NJS_PACKAGE] if key else [])], update=True, no_recommends=True
        )
    if key is not None and script_changed:
        yield StringCommand("install", "-d", "-m", "755", NGINX_SCRIPTS)
        yield AtomicUpload(as_io(script), key.script, "644")
    if changed:
        yield AtomicUpload(as_io(content), proxy_path(spec.service), "644")
    if seen.default_config or not seen.nginx:
        yield StringCommand("rm", "-f", NGINX_DEFAULT_CONFIG)
    # A site nginx refuses is not loaded; the running nginx keeps serving.
    yield StringCommand("nginx", "-t", "-q")
    yield StringCommand("systemctl", "enable", "nginx")
    yield StringCommand("systemctl", "reload-or-restart", "nginx")


@operation()
def members(spec: RouterSpec, seen: RouterHost) -> Commands:
    """The members file the unit replays, written before any restart."""
    content = spec.members_text()
    if seen.members_sha256 == sha256(content):
        host.noop(f"{spec.members_file} lists the {len(spec.workers)} workers")
        return
    if seen.members_sha256 is None:
        yield StringCommand("install", "-d", "-m", "755", shlex.quote(MEMBERS_DIR))
    yield AtomicUpload(as_io(content), spec.members_file, "644")


@operation()
def workers_in_step(spec: RouterSpec, seen: RouterHost, install: LockedInstall) -> Commands:
    """The running router's worker set made this run's workers, without a restart."""
    restarted = _router_snapshot_changes(spec, seen, install) or not seen.running or seen.live_workers is None
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
        # The unit's rejoin may add it first, so a refused add is judged by the list.
        is_listed = f"curl -fsS --max-time 5 {listed} | grep -qF {shlex.quote(json.dumps(url))}"
        yield StringCommand(
            "sh",
            "-c",
            shlex.quote(
                f"{is_listed} || curl -fsS -X POST --max-time {spec.worker_startup_timeout_s + 10} {add} || {is_listed}"
            ),
        )
    for url in sorted(live - wanted):
        yield StringCommand(
            "curl",
            "-fsS",
            "-X",
            "POST",
            "--max-time",
            "30",
            shlex.quote(f"{spec.control_url}/remove_worker?url={quote(url, safe='')}"),
        )
