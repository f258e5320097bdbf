"""Docker engine: installed (Docker's repo or the distribution's docker.io), running, restarted on config change."""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.operations import apt

from gpufleet.operations.base import Commands
from gpufleet.operations.files import put_content
from gpufleet.operations.run import snapshot
from gpufleet.vllm.layout import Layout, Managed
from gpufleet.vllm.operations.repo_keys import dearmor, install_fetched_key, key_commands

DOCKER_KEY = "/etc/apt/keyrings/docker.asc"
DOCKER_LIST = "/etc/apt/sources.list.d/docker.list"
CE_PACKAGES = ["docker-ce", "docker-ce-cli", "containerd.io"]


def managed(layout: Layout) -> Managed:
    # Read whatever docker_install is: a host switching to docker-ce must not upload the same key twice.
    return Managed(files=(DOCKER_KEY, DOCKER_LIST))


def key_url(repo_url: str, os_id: str) -> str:
    return f"{repo_url.rstrip('/')}/{os_id}/gpg"


def armored(text: str) -> bytes:
    """Docker's key file is the armored key as served (apt reads .asc keyrings): checked, stored as it is."""
    dearmor(text)  # raises ValueError for anything but an armored public key block (an HTML error page)
    return text.encode()


def repo_line(repo_url: str, os_id: str, codename: str, arch: str) -> str:
    """Docker's documented apt source: <base>/<os id> <codename> stable, signed by its own key."""
    return f"deb [arch={arch} signed-by={DOCKER_KEY}] {repo_url.rstrip('/')}/{os_id} {codename} stable\n"


@operation()
def engine(install: str = "docker-ce", repo_url: str = "https://download.docker.com/linux",
           refresh_keys: bool = False) -> Commands:
    """Install the Docker engine: docker-ce from Docker's repo, or the distribution's docker.io ("distro").

    docker-ce's key (`<repo_url>/<os id>/gpg`, kept as /etc/apt/keyrings/docker.asc) is decided as the NVIDIA
    repo's is (gpufleet.vllm.operations.repo_keys.key_commands): the installed key stands unless refresh_keys
    (gpufleet_refresh_keys) fetched a different one; it is fetched while executing when missing, or when apt is
    about to read the repo (a package to install, a changed source line).

        docker.engine(install="docker-ce", repo_url="https://download.docker.com/linux", refresh_keys=False)
    """
    snap = snapshot()
    if install == "distro":
        # docker-ce on the host with docker_install "distro" never gets here: preflight refuses the swap.
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
    fetch = FunctionCommand(install_fetched_key, (url, DOCKER_KEY, armored, snap.file_sha256.get(DOCKER_KEY),
                                                  "docker_repo_url"), {})
    changed = False
    for command in key_commands(snap, DOCKER_KEY, snap.docker_key.encode() if snap.docker_key else None, fetch,
                                bool(missing or list_commands), refresh_keys, url):
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
