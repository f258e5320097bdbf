"""Docker engine: installed (Docker's repo or the distribution's docker.io), running, restarted on config change."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import StringCommand, operation
from pyinfra.operations import apt

from gpufleet.operations.files import put_content
from gpufleet.operations.layout import Layout, Managed
from gpufleet.operations.remote import Commands
from gpufleet.operations.snapshot import snapshot

DOCKER_KEY = "/etc/apt/keyrings/docker.asc"
DOCKER_LIST = "/etc/apt/sources.list.d/docker.list"
CE_PACKAGES = ["docker-ce", "docker-ce-cli", "containerd.io"]


def managed(layout: Layout) -> Managed:
    # Read whatever docker_install is: a host switching to docker-ce must not upload the same key twice.
    return Managed(files=(DOCKER_KEY, DOCKER_LIST))


def key_url(repo_url: str, os_id: str) -> str:
    return f"{repo_url.rstrip('/')}/{os_id}/gpg"


def fetch_key_command(repo_url: str, os_id: str) -> StringCommand:
    # The URL is a setting: quoted, so `&`, `;` or `$(` in it can never reach the root shell as syntax.
    return StringCommand("curl", "-fsSL", shlex.quote(key_url(repo_url, os_id)), "-o", DOCKER_KEY)


def repo_line(repo_url: str, os_id: str, codename: str, arch: str) -> str:
    """Docker's documented apt source: <base>/<os id> <codename> stable, signed by its own key."""
    return f"deb [arch={arch} signed-by={DOCKER_KEY}] {repo_url.rstrip('/')}/{os_id} {codename} stable\n"


@operation()
def engine(install: str = "docker-ce", repo_url: str = "https://download.docker.com/linux") -> Commands:
    """Install the Docker engine: docker-ce from Docker's repo, or the distribution's docker.io ("distro")."""
    snap = snapshot()
    if install == "distro":
        # docker-ce on the host with docker_install "distro" never gets here: preflight refuses the swap.
        if snap.installed("docker.io"):
            host.noop(f"docker.io {snap.packages['docker.io']} is installed")
            return
        yield from apt.packages._inner(packages=["docker.io"], update=True, no_recommends=True)
        return

    changed = False
    if snap.docker_key is None:
        # The snapshot could not fetch the key (no curl yet): fetch it on the host once curl is installed.
        yield StringCommand("install", "-d", "-m", "755", "/etc/apt/keyrings")
        yield fetch_key_command(repo_url, snap.os.get("ID", "debian"))
        changed = True
    else:
        for command in put_content(DOCKER_KEY, snap.docker_key):
            changed = True
            yield command
    line = repo_line(repo_url, snap.os.get("ID", "debian"), snap.os.get("VERSION_CODENAME", ""), snap.arch)
    for command in put_content(DOCKER_LIST, line):
        changed = True
        yield command
    missing = [p for p in CE_PACKAGES if not snap.installed(p)]
    if missing:
        yield from apt.packages._inner(packages=missing, update=True, no_recommends=True)
    elif changed:
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
