"""Docker engine: installed (Docker's repo or the distribution's docker.io), running, restarted on config change."""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import StringCommand, operation
from pyinfra.operations import apt

from gpufleet.operations.context import snapshot
from gpufleet.operations.files import put_content

DOCKER_KEY = "/etc/apt/keyrings/docker.asc"
DOCKER_LIST = "/etc/apt/sources.list.d/docker.list"
CE_PACKAGES = ["docker-ce", "docker-ce-cli", "containerd.io"]


def repo_line(repo_url: str, os_id: str, codename: str, arch: str) -> str:
    """Docker's documented apt source: <base>/<os id> <codename> stable, signed by its own key."""
    return f"deb [arch={arch} signed-by={DOCKER_KEY}] {repo_url.rstrip('/')}/{os_id} {codename} stable\n"


@operation()
def engine(install: str = "docker-ce", repo_url: str = "https://download.docker.com/linux"):
    """Install the Docker engine: docker-ce from Docker's repo, or the distribution's docker.io ("distro")."""
    snap = snapshot()
    if install == "distro":
        if snap.installed("docker.io") or snap.installed("docker-ce"):
            host.noop("Docker is installed (" + ", ".join(p for p in ("docker.io", "docker-ce") if snap.installed(p)) + ")")
            return
        yield from apt.packages._inner(packages=["docker.io"], update=True, no_recommends=True)
        return

    changed = False
    if snap.docker_key is None:
        # The snapshot could not fetch the key (no curl yet): fetch it on the host once curl is installed.
        yield StringCommand("install", "-d", "-m", "755", "/etc/apt/keyrings")
        yield StringCommand("curl", "-fsSL", f"{repo_url.rstrip('/')}/{snap.os.get('ID', 'debian')}/gpg", "-o", DOCKER_KEY)
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
def running():
    """Start the Docker engine and enable it at boot."""
    snap = snapshot()
    if snap.unit_active("docker.service") and snap.unit_enabled("docker.service"):
        host.noop("docker.service is active and enabled")
        return
    yield StringCommand("systemctl", "enable", "--now", "docker.service")


@operation(is_idempotent=False)
def restarted(why: str = "its configuration changed"):
    """Restart Docker (call with _if=<op>.did_change: only when its configuration changed)."""
    yield StringCommand("systemctl", "restart", "docker.service")
