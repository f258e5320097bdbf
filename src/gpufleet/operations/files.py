"""Files and directories the deploy owns, decided from the snapshot's checksums and stat lines."""

from __future__ import annotations

import hashlib
import shlex
from io import BytesIO

from pyinfra import host
from pyinfra.api import FileUploadCommand, FunctionCommand, Host, State, StringCommand, operation
from pyinfra.operations import apt

from gpufleet.operations.remote import Commands, use_sudo
from gpufleet.operations.secret import Hidden
from gpufleet.operations.snapshot import snapshot


def sha256(content: str | bytes) -> str:
    return hashlib.sha256(content.encode() if isinstance(content, str) else content).hexdigest()


def as_io(content: str | bytes) -> BytesIO:
    return BytesIO(content.encode() if isinstance(content, str) else content)


def put_content(path: str, content: str | bytes, mode: str = "644") -> Commands:
    """Yield the commands that make `path` hold `content` (root-owned), or nothing when it already does.

    For use inside operations (`yield from put_content(...)`); the decision comes from the snapshot's sha256.
    """
    if snapshot().file_sha256.get(path) == sha256(content):
        return
    directory = path.rsplit("/", 1)[0] or "/"
    yield StringCommand("install", "-d", "-m", "755", shlex.quote(directory))
    yield FileUploadCommand(as_io(content), path)
    yield StringCommand("chown", "root:root", shlex.quote(path), "&&", "chmod", shlex.quote(mode), shlex.quote(path))


def _install_secret(state: State, host: Host, path: str, secret: Hidden) -> bool:
    # Upload as the SSH user into a fresh 0700 directory, then install as root with 0600: the secret never sits in
    # a world-readable temp file and never appears on a command line.
    ok, output = host.run_shell_command("umask 077 && mktemp -d")
    if not ok:
        raise RuntimeError(f"could not create a private temp dir: {output.stderr}")
    tmpdir = output.stdout_lines[-1].strip()
    try:
        if not host.put_file(as_io(secret.reveal()), f"{tmpdir}/secret"):
            raise RuntimeError("upload failed")
        directory = path.rsplit("/", 1)[0]
        ok, output = host.run_shell_command(
            f"install -d -m 700 -o root -g root {shlex.quote(directory)} && "
            f"install -m 600 -o root -g root {shlex.quote(tmpdir + '/secret')} {shlex.quote(path)}",
            _sudo=use_sudo(host),
        )
        if not ok:
            raise RuntimeError(f"could not install {path}: {output.stderr}")
    finally:
        host.run_shell_command(f"rm -rf {shlex.quote(tmpdir)}")
    return True


def put_secret(path: str, content: str) -> Commands:
    """Like put_content, for a root-only 0600 file holding secrets."""
    if snapshot().file_sha256.get(path) == sha256(content):
        return
    yield FunctionCommand(_install_secret, (path, Hidden(content)), {})


@operation()
def directories(paths: list[str], user: str = "root", group: str = "root", mode: str = "755") -> Commands:
    """Create directories with the given owner and mode (only those missing or owned/moded otherwise)."""
    wrong = [p for p in paths if snapshot().dirs.get(p) != (user, group, mode.lstrip("0") or "0")]
    if not wrong:
        host.noop(f"{len(paths)} directories exist, {user}:{group} {mode}")
        return
    quoted = [shlex.quote(p) for p in wrong]
    yield StringCommand("install", "-d", "-o", shlex.quote(user), "-g", shlex.quote(group), "-m", shlex.quote(mode),
                        *quoted)


@operation()
def prerequisites(packages: tuple[str, ...] = ("ca-certificates", "curl")) -> Commands:
    """Install what fetching the signed repos needs (TLS roots, curl)."""
    missing = [p for p in packages if not snapshot().installed(p)]
    if not missing:
        host.noop(", ".join(packages) + " installed")
        return
    yield from apt.packages._inner(packages=missing, update=True, no_recommends=True)
