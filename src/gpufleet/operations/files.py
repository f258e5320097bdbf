"""Files and directories the deploy owns, decided from the snapshot's checksums and stat lines."""

from __future__ import annotations

import hashlib
import shlex
from io import BytesIO

from pyinfra import host
from pyinfra.api import FileUploadCommand, FunctionCommand, Host, State, StringCommand, operation
from pyinfra.api.arguments import ConnectorArguments
from pyinfra.operations import apt

from gpufleet.hoststate.atomic import atomic_write_command
from gpufleet.operations.base import Commands
from gpufleet.operations.run import snapshot
from gpufleet.operations.secret import Hidden
from gpufleet.remote.ssh import use_sudo


def sha256(content: str | bytes) -> str:
    return hashlib.sha256(content.encode() if isinstance(content, str) else content).hexdigest()


def as_io(content: str | bytes) -> BytesIO:
    return BytesIO(content.encode() if isinstance(content, str) else content)


def temp_path(path: str) -> str:
    """Where a new version of `path` is written before it replaces it: the same directory (a rename within one
    filesystem is atomic), a hidden name without a unit suffix (systemd ignores it if a run dies there)."""
    directory, _, name = path.rpartition("/")
    return f"{directory}/.{name}.gpufleet-tmp"


def replace_command(tmp: str, path: str) -> str:
    """Shell: flush `tmp` to disk, rename it over `path`, flush the directory. A cut at any point leaves the old
    file or the new one, whole, never a truncated mix (and the next run's checksum decides)."""
    directory = path.rpartition("/")[0] or "/"
    return (f"sync {shlex.quote(tmp)} && mv -f {shlex.quote(tmp)} {shlex.quote(path)} && "
            f"sync {shlex.quote(directory)}")


class AtomicUpload(FileUploadCommand):
    """Upload `src` to `dest` through a temp file beside it: owner and mode set on the temp file, then fsync and
    rename. A plain upload writes the destination in place (SFTP as root), and an SSH cut leaves half a file."""

    def __init__(self, src: BytesIO, dest: str, mode: str):
        super().__init__(src, dest)
        self.mode = mode

    def execute(self, state: State, host: Host, connector_arguments: ConnectorArguments) -> bool:
        connector_arguments.update(self.connector_arguments)
        tmp = temp_path(self.dest)
        shown = {"print_output": state.print_output, "print_input": state.print_input}
        if not host.put_file(self.src, tmp, **shown, **connector_arguments):
            return False
        ok, _ = host.run_shell_command(
            f"chown root:root {shlex.quote(tmp)} && chmod {shlex.quote(self.mode)} {shlex.quote(tmp)} && "
            + replace_command(tmp, self.dest), **shown, **connector_arguments)
        return bool(ok)


# What a guarded command prints when its guard refuses: the caller tells that refusal from a failed write.
REFUSED = "@@gpufleet:write-refused"


def guarded(command: str, only_if: str | None, cleanup: str = "") -> str:
    """`command`, run only when the shell test `only_if` holds on the host (None: always); else `cleanup` runs, REFUSED
    is printed and the shell exits 3."""
    if only_if is None:
        return command
    return f"if ! {{ {only_if}; }}; then {cleanup}echo {REFUSED}; exit 3; fi; {command}"


def write_file(host: Host, path: str, content: str, mode: str = "0644", only_if: str | None = None) -> bool | None:
    """From a FunctionCommand: replace the root-owned `path` with `content` atomically (gpufleet.hoststate.ledger's
    atomic_write_command: temp file beside it, fsync, rename, directory fsync). For files written while executing,
    whose content is known only then (the ledger). only_if: a shell test run in the same command right before the
    rename; when it is false nothing is replaced and the answer is None (False: the write itself failed)."""
    sudo = use_sudo(host)
    directory, _, name = path.rpartition("/")
    upload = f"{directory}/.{name}.upload"
    ok = host.run_shell_command(f"install -d -m 755 {shlex.quote(directory)}", _sudo=sudo)[0]
    if not (ok and host.put_file(as_io(content), upload, _sudo=sudo)):
        return False
    write = guarded(atomic_write_command(path, mode=mode, source=upload), only_if,
                    cleanup=f"rm -f {shlex.quote(upload)}; ")
    ok, output = host.run_shell_command(write, _sudo=sudo)
    if not ok and REFUSED in output.stdout_lines:
        return None
    return bool(ok)


def put_content(path: str, content: str | bytes, mode: str = "644") -> Commands:
    """Yield the commands that make `path` hold `content` (root-owned, replaced atomically), or nothing when it
    already does.

    For use inside operations (`yield from put_content(...)`); the decision comes from the snapshot's sha256.
    """
    if snapshot().file_sha256.get(path) == sha256(content):
        return
    directory = path.rsplit("/", 1)[0] or "/"
    yield StringCommand("install", "-d", "-m", "755", shlex.quote(directory))
    yield AtomicUpload(as_io(content), path, mode)


def _install_secret(state: State, host: Host, path: str, secret: Hidden) -> bool:
    # Upload as the SSH user into a fresh 0700 directory, then install it as root with 0600 beside the target and
    # rename it over: the secret never sits in a world-readable temp file, never appears on a command line, and
    # the env file is never half written.
    ok, output = host.run_shell_command("umask 077 && mktemp -d")
    if not ok:
        raise RuntimeError(f"could not create a private temp dir: {output.stderr}")
    tmpdir = output.stdout_lines[-1].strip()
    try:
        if not host.put_file(as_io(secret.reveal()), f"{tmpdir}/secret"):
            raise RuntimeError("upload failed")
        directory = path.rsplit("/", 1)[0]
        tmp = temp_path(path)
        ok, output = host.run_shell_command(
            f"install -d -m 700 -o root -g root {shlex.quote(directory)} && "
            f"install -m 600 -o root -g root {shlex.quote(tmpdir + '/secret')} {shlex.quote(tmp)} && "
            + replace_command(tmp, path),
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
