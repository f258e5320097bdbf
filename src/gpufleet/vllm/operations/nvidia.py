"""The NVIDIA container toolkit: its apt repo, package and Docker runtime; and the driver's version file."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.operations import apt

from gpufleet.hoststate.paths import STATE_DIR
from gpufleet.operations.base import Commands
from gpufleet.operations.files import put_content, replace_command, temp_path
from gpufleet.vllm.host_command import DAEMON_JSON
from gpufleet.vllm.layout import Layout, Managed
from gpufleet.vllm.operations.repo_keys import dearmor, install_fetched_key, key_commands
from gpufleet.vllm.snapshot import snapshot

KEYRING = "/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg"
LIST = "/etc/apt/sources.list.d/nvidia-container-toolkit.list"
PACKAGE = "nvidia-container-toolkit"
# `nvidia-smi --version` as last read live. Not *.json: the snapshot reads those as ledgers.
VERSION_FILE = f"{STATE_DIR}/nvidia-version"


def managed(layout: Layout) -> Managed:
    return Managed(files=(KEYRING, LIST, VERSION_FILE))


def key_url(repo_url: str) -> str:
    return f"{repo_url.rstrip('/')}/gpgkey"


def list_line(repo_url: str) -> str:
    # apt substitutes the literal $(ARCH), as in NVIDIA's own list file.
    return f"deb [signed-by={KEYRING}] {repo_url.rstrip('/')}/stable/deb/$(ARCH) /\n"


@operation()
def toolkit_repo(
    repo_url: str = "https://nvidia.github.io/libnvidia-container", refresh_keys: bool = False
) -> Commands:
    """Add NVIDIA's container-toolkit apt repo, signed by its key (docs/deploy.md, "Repo keys")."""
    snap = snapshot()
    url = key_url(repo_url)
    list_commands = list(put_content(LIST, list_line(repo_url)))
    fetch = FunctionCommand(
        install_fetched_key, (url, KEYRING, dearmor, snap.file_sha256.get(KEYRING), "nvidia_repo_url"), {}
    )
    served = dearmor(snap.nvidia_key) if snap.nvidia_key is not None else None
    changed = False
    for command in key_commands(
        snap, KEYRING, served, fetch, not snap.installed(PACKAGE) or bool(list_commands), refresh_keys, url
    ):
        changed = True
        yield command
    yield from list_commands
    if not changed and not list_commands:
        host.noop(f"{LIST} and its keyring match {repo_url}")


@operation()
def toolkit() -> Commands:
    """Install the NVIDIA container toolkit."""
    snap = snapshot()
    if snap.installed(PACKAGE):
        host.noop(f"{PACKAGE} {snap.packages[PACKAGE]} is installed")
        return
    # The list file may be new.
    yield from apt.packages._inner(packages=[PACKAGE], update=True, no_recommends=True)


@operation()
def docker_runtime() -> Commands:
    """Register the nvidia runtime in daemon.json, other keys kept."""
    snap = snapshot()
    if snap.nvidia_runtime:
        host.noop("daemon.json has runtimes.nvidia")
        return
    # Only when missing: nvidia-ctk rewrites the file, which restarts Docker.
    yield StringCommand(configure_runtime_command())


@operation()
def version_file() -> Commands:
    """Record `nvidia-smi --version` for the next snapshots to print while the GPUs report that driver."""
    snap = snapshot()
    if snap.driver_output is None:
        if snap.driver_from_file and snap.driver is not None:
            host.noop(f"{VERSION_FILE} names driver {snap.driver.driver_version}, the one the GPUs report")
        else:
            host.noop("no usable `nvidia-smi --version` on this host: nothing to record")
        return
    changed = False
    for command in put_content(VERSION_FILE, snap.driver_output):
        changed = True
        yield command
    if not changed:
        host.noop(f"{VERSION_FILE} holds what nvidia-smi --version answered")


def configure_runtime_command(path: str = DAEMON_JSON) -> str:
    """Configure a copy, then replace daemon.json: a cut nvidia-ctk write leaves a file dockerd refuses."""
    tmp = temp_path(path)
    q = shlex.quote
    return (
        f"install -d -m 755 {q(path.rpartition('/')[0])} && rm -f {q(tmp)} && "
        f"{{ [ ! -e {q(path)} ] || cp -p {q(path)} {q(tmp)}; }} && "
        f"nvidia-ctk runtime configure --runtime=docker --config={q(tmp)} && " + replace_command(tmp, path)
    )
