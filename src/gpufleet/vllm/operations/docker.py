"""The Docker engine: installed, running, restarted on a config change, trusting the site cache."""

from __future__ import annotations

import json
from collections.abc import Collection

from pyinfra import host
from pyinfra.api import FunctionCommand, Host, State, StringCommand, operation
from pyinfra.operations import apt

from gpufleet.hoststate.paths import STATE_DIR
from gpufleet.operations.base import Commands, fail
from gpufleet.operations.files import put_content, sha256, write_file
from gpufleet.remote.ssh import use_sudo
from gpufleet.vllm.host_command import DAEMON_JSON
from gpufleet.vllm.layout import Layout, Managed
from gpufleet.vllm.operations.repo_keys import dearmor, install_fetched_key, key_commands
from gpufleet.vllm.snapshot import snapshot

DOCKER_KEY = "/etc/apt/keyrings/docker.asc"
DOCKER_LIST = "/etc/apt/sources.list.d/docker.list"
TRUSTED = f"{STATE_DIR}/site-cache.trusted"  # the cache address gpufleet put in insecure-registries
_RECORDED = "@@gpufleet:trusted"
CE_PACKAGES = ["docker-ce", "docker-ce-cli", "containerd.io"]


def managed(layout: Layout) -> Managed:
    # Whatever docker_install is: a host switching to docker-ce must not upload the key twice.
    return Managed(files=(DOCKER_KEY, DOCKER_LIST, TRUSTED))


def key_url(repo_url: str, os_id: str) -> str:
    return f"{repo_url.rstrip('/')}/{os_id}/gpg"


def armored(text: str) -> bytes:
    """Docker's key file, stored armored as served (apt reads .asc keyrings)."""
    dearmor(text)  # raises ValueError for an HTML error page
    return text.encode()


def repo_line(repo_url: str, os_id: str, codename: str, arch: str) -> str:
    """Docker's documented apt source line."""
    return f"deb [arch={arch} signed-by={DOCKER_KEY}] {repo_url.rstrip('/')}/{os_id} {codename} stable\n"


@operation()
def engine(
    install: str = "docker-ce", repo_url: str = "https://download.docker.com/linux", refresh_keys: bool = False
) -> Commands:
    """Install the Docker engine: docker-ce from Docker's repo, or the distribution's docker.io ("distro")."""
    snap = snapshot()
    if install == "distro":
        # Preflight refuses a swap from docker-ce.
        if snap.installed("docker.io"):
            host.noop(f"docker.io {snap.packages['docker.io']} is installed")
            return
        yield from apt.packages._inner(packages=["docker.io"], update=True, no_recommends=True)
        return

    os_id = snap.os.get("ID", "debian")
    url = key_url(repo_url, os_id)
    line = repo_line(repo_url, os_id, snap.os.get("VERSION_CODENAME", ""), snap.arch)
    list_commands = list(put_content(DOCKER_LIST, line))
    missing = [p for p in CE_PACKAGES if not snap.installed(p)]
    fetch = FunctionCommand(
        install_fetched_key, (url, DOCKER_KEY, armored, snap.file_sha256.get(DOCKER_KEY), "docker_repo_url"), {}
    )
    changed = False
    for command in key_commands(
        snap,
        DOCKER_KEY,
        snap.docker_key.encode() if snap.docker_key else None,
        fetch,
        bool(missing or list_commands),
        refresh_keys,
        url,
    ):
        changed = True
        yield command
    yield from list_commands
    if missing:
        yield from apt.packages._inner(packages=missing, update=True, no_recommends=True)
    elif changed or list_commands:
        yield StringCommand("apt-get", "update", "-q")
    else:
        host.noop("docker-ce is installed from " + repo_url)


@operation()
def running() -> Commands:
    """Start the Docker engine and enable it at boot."""
    snap = snapshot()
    if snap.unit_active("docker.service") and snap.unit_enabled("docker.service"):
        host.noop("docker.service is active and enabled")
        return
    yield StringCommand("systemctl", "enable", "--now", "docker.service")


@operation(is_idempotent=False)
def restarted() -> Commands:
    """Restart Docker (call with _if=<op>.did_change: only when its configuration changed)."""
    yield StringCommand("systemctl", "restart", "docker.service")


def with_insecure_registry(text: str | None, address: str | None, drop: Collection[str] = ()) -> str | None:
    """daemon.json with `address` in insecure-registries and `drop` out of it; None when unchanged.

    Raises ValueError for a file that is not a JSON object, which is never overwritten."""
    doc = json.loads(text) if text and text.strip() else {}
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    listed = doc.get("insecure-registries") or []
    if not isinstance(listed, list):
        raise ValueError("insecure-registries is not a list")
    kept = [entry for entry in listed if entry not in drop or entry == address]
    if address is not None and address not in kept:
        kept.append(address)
    if kept == listed:
        return None
    doc["insecure-registries"] = kept
    return json.dumps(doc, indent=4, sort_keys=True) + "\n"


def _trust(state: State, host: Host, address: str | None) -> bool:
    # nvidia-ctk may have rewritten the file in this run, after the snapshot.
    sudo = use_sudo(host)
    ok, output = host.run_shell_command(
        f"cat {DAEMON_JSON} 2>/dev/null; echo {_RECORDED}; cat {TRUSTED} 2>/dev/null; true", _sudo=sudo
    )
    text, _, recorded = (output.stdout if ok else "").partition(_RECORDED)
    try:
        merged = with_insecure_registry(text, address, drop=set(recorded.split()))
    except ValueError as error:
        return fail(
            host,
            f"{DAEMON_JSON}: {error}: the site cache {address} was not added (fix: make it a JSON "
            'object, or set site_cache_address "off" for this host)',
        )
    if merged is not None:
        if not write_file(host, DAEMON_JSON, merged):
            return False
        # A Docker not running yet reads the file when it starts.
        if not host.run_shell_command("systemctl try-reload-or-restart docker.service", _sudo=sudo)[0]:
            return fail(host, f"{DAEMON_JSON} changed, but docker did not reload it (fix: `systemctl status docker`)")
    if address is None:
        return bool(host.run_shell_command(f"rm -f {TRUSTED}", _sudo=sudo)[0])
    return bool(write_file(host, TRUSTED, f"{address}\n"))


@operation()
def trusts_site_cache(address: str | None) -> Commands:
    """Let Docker pull from the site cache at `address` over plain HTTP, and from no cache trusted before."""
    snap = snapshot()
    listed = (snap.daemon_json or {}).get("insecure-registries") or []
    record = sha256(f"{address}\n") if address else None
    if (address is None or address in listed) and snap.file_sha256.get(TRUSTED) == record:
        host.noop(f"{DAEMON_JSON} lists {address} in insecure-registries" if address else "no site cache to trust")
        return
    yield FunctionCommand(_trust, (address,), {})
