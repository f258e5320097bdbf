"""NVIDIA container toolkit: signed apt repo, package, and Docker's nvidia runtime (merged into daemon.json); the
driver's version file, which spares the host snapshot one nvidia-smi call."""

from __future__ import annotations

import base64
import binascii
import shlex
from collections.abc import Callable

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, Host, State, StringCommand, operation
from pyinfra.operations import apt

from gpufleet.facts.host import DAEMON_JSON, HostSnapshot
from gpufleet.operations.files import as_io, put_content, replace_command, sha256, temp_path
from gpufleet.operations.layout import STATE_DIR, Layout, Managed
from gpufleet.operations.remote import Commands, fail, use_sudo
from gpufleet.operations.snapshot import snapshot

KEYRING = "/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg"
LIST = "/etc/apt/sources.list.d/nvidia-container-toolkit.list"
PACKAGE = "nvidia-container-toolkit"
# `nvidia-smi --version` as the snapshot last read it live (gpufleet.facts.host.driver_lines reads it back). Not
# *.json: the snapshot takes the state dir's JSON files for ledgers.
VERSION_FILE = f"{STATE_DIR}/nvidia-version"


def managed(layout: Layout) -> Managed:
    return Managed(files=(KEYRING, LIST, VERSION_FILE))


def key_url(repo_url: str) -> str:
    return f"{repo_url.rstrip('/')}/gpgkey"


def dearmor(armored: str) -> bytes:
    """`gpg --dearmor` in Python: the base64 body of an ASCII-armored key block (armor headers and CRC dropped).

    Done here so the host needs no gnupg and the comparison with the installed keyring is a checksum.
    """
    lines = armored.strip().splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("-----BEGIN PGP PUBLIC KEY BLOCK"))
        end = next(i for i, line in enumerate(lines) if line.startswith("-----END PGP PUBLIC KEY BLOCK"))
    except StopIteration:
        raise ValueError("not an ASCII-armored PGP public key block") from None
    body = lines[start + 1:end]
    if "" in body:  # armor headers ("Comment: ...") end at the first blank line
        body = body[body.index("") + 1:]
    body = [line.strip() for line in body if line.strip() and not line.startswith("=")]
    try:
        return base64.b64decode("".join(body), validate=True)
    except binascii.Error as error:
        raise ValueError(f"bad base64 in the armored key: {error}") from None


def list_line(repo_url: str) -> str:
    # NVIDIA's own list file uses the literal $(ARCH), which apt substitutes with the host's architecture.
    return f"deb [signed-by={KEYRING}] {repo_url.rstrip('/')}/stable/deb/$(ARCH) /\n"


def fetch_key_command(url: str) -> str:
    # The URL is a setting: quoted, so `&`, `;`, `$(` or a quote in it can never reach the shell as syntax.
    return f"curl -fsSL --max-time 60 {shlex.quote(url)}"


def install_fetched_key(state: State, host: Host, url: str, path: str, as_file: Callable[[str], bytes],
                        installed_sha256: str | None, setting: str) -> bool:
    """FunctionCommand: fetch the repo key at `url` on the host and make `path` hold what as_file makes of the
    armored text (it raises ValueError for anything else), unless the installed file already does. A fetch that
    fails ends the host's run on one line naming host, URL and fix: apt is about to read the repo with that key."""
    ok, output = host.run_shell_command(fetch_key_command(url))
    try:
        if not ok:
            raise ValueError(" ".join(output.stderr_lines).strip()[:200] or "curl failed")
        content = as_file("\n".join(output.stdout_lines).strip() + "\n")
    except ValueError as error:
        return fail(host, f"{host.name}: could not fetch the repo key {url}: {error} (fix: make {url} reachable "
                          f"from {host.name}, or set {setting} to a mirror that serves it)")
    if sha256(content) == installed_sha256:
        return True  # the installed key is the one served: nothing to write
    sudo, tmp = use_sudo(host), temp_path(path)
    q = shlex.quote
    return bool(host.run_shell_command(f"install -d -m 755 {q(path.rpartition('/')[0])}", _sudo=sudo)[0]
                and host.put_file(as_io(content), tmp, _sudo=sudo)
                and host.run_shell_command(f"chown root:root {q(tmp)} && chmod 644 {q(tmp)} && "
                                           + replace_command(tmp, path), _sudo=sudo)[0])


def key_commands(snap: HostSnapshot, path: str, served: bytes | None, fetch: FunctionCommand, apt_reads_repo: bool,
                 refresh: bool, url: str) -> Commands:
    """The commands that keep a repo's key file current, decided from the snapshot: the key as served (`served`,
    when the snapshot fetched it: a missing file, or refresh) replaces a different file; without it, `fetch` runs
    while executing when there is no file yet (the snapshot had no curl, or the key server did not answer) or apt
    is about to read the repo anyway (a package to install, a changed source line), so a rotated key is picked up
    whenever gpufleet installs; otherwise the installed key stands. A refresh whose fetch failed keeps it, saying
    so once."""
    if served is not None:
        yield from put_content(path, served)
    elif path not in snap.file_sha256 or apt_reads_repo:
        yield fetch
    elif refresh and host.state.is_executing:  # said while executing: a plan that checks for changes runs this too
        host.log_styled(f"{host.name}: could not fetch {url} to check for a rotated key; kept the installed "
                        f"{path}", fg="yellow", log_func=logger.warning)


@operation()
def repository(repo_url: str = "https://nvidia.github.io/libnvidia-container", refresh_keys: bool = False) -> Commands:
    """Add NVIDIA's container-toolkit apt repo, signed by its key.

    The installed keyring stands: the snapshot fetches `<repo_url>/gpgkey` only when the keyring is missing or
    refresh_keys (gpufleet_refresh_keys) asks, and a key fetched that way replaces a different keyring (a rotated
    key). When the toolkit is still to be installed or the list file changes, apt reads the repo in this run: the
    key is fetched first, while executing, and a failed fetch fails the host. A refresh whose fetch failed keeps
    the installed keyring with a warning.

        nvidia.repository(repo_url="https://nvidia.github.io/libnvidia-container", refresh_keys=False)
    """
    snap = snapshot()
    url = key_url(repo_url)
    list_commands = list(put_content(LIST, list_line(repo_url)))
    fetch = FunctionCommand(install_fetched_key, (url, KEYRING, dearmor, snap.file_sha256.get(KEYRING),
                                                  "nvidia_repo_url"), {})
    served = dearmor(snap.nvidia_key) if snap.nvidia_key is not None else None
    changed = False
    for command in key_commands(snap, KEYRING, served, fetch, not snap.installed(PACKAGE) or bool(list_commands),
                                refresh_keys, url):
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
    # update=True: the list file was (re)written just before; apt must read the new repo.
    yield from apt.packages._inner(packages=[PACKAGE], update=True, no_recommends=True)


@operation()
def docker_runtime() -> Commands:
    """Register the nvidia runtime with Docker (nvidia-ctk merges it into daemon.json; other keys stay)."""
    snap = snapshot()
    if snap.nvidia_runtime:
        host.noop("daemon.json has runtimes.nvidia")
        return
    # Only when missing: nvidia-ctk rewrites the file, so running it every time would churn and restart Docker.
    yield StringCommand(configure_runtime_command())


@operation()
def version_file() -> Commands:
    """Record the driver's version and CUDA version on the host: the next snapshots print the file instead of
    running `nvidia-smi --version`, for as long as the GPU query reports the driver it names."""
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
    """nvidia-ctk merges the runtime into a copy beside daemon.json, which then replaces it atomically: nvidia-ctk
    writes its --config in place, and a cut there would leave dockerd a truncated file it refuses to start with."""
    tmp = temp_path(path)
    q = shlex.quote
    return (f"install -d -m 755 {q(path.rpartition('/')[0])} && rm -f {q(tmp)} && "
            f"{{ [ ! -e {q(path)} ] || cp -p {q(path)} {q(tmp)}; }} && "
            f"nvidia-ctk runtime configure --runtime=docker --config={q(tmp)} && " + replace_command(tmp, path))
