"""Files and directories the deploy owns, decided from the snapshot's checksums and stat lines."""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Mapping
from io import BytesIO
from typing import Any

from pyinfra import host
from pyinfra.api import FileUploadCommand, FunctionCommand, Host, State, StringCommand, operation
from pyinfra.api.arguments import ConnectorArguments
from pyinfra.operations import apt

from gpufleet.hoststate.atomic import atomic_write_command
from gpufleet.operations.base import Commands
from gpufleet.operations.run import snapshot, still_held_test
from gpufleet.operations.secret import Hidden
from gpufleet.remote.ssh import use_sudo


def sha256(content: str | bytes) -> str:
    return hashlib.sha256(content.encode() if isinstance(content, str) else content).hexdigest()


def as_io(content: str | bytes) -> BytesIO:
    return BytesIO(content.encode() if isinstance(content, str) else content)


def temp_path(path: str) -> str:
    """Beside `path`, so the rename is atomic, and without a unit suffix, so systemd ignores a leftover."""
    directory, _, name = path.rpartition("/")
    return f"{directory}/.{name}.gpufleet-tmp"


def replace_command(tmp: str, path: str) -> str:
    directory = path.rpartition("/")[0] or "/"
    return f"sync {shlex.quote(tmp)} && mv -f {shlex.quote(tmp)} {shlex.quote(path)} && sync {shlex.quote(directory)}"


class AtomicUpload(FileUploadCommand):
    """An upload() while this run holds the lock; a plain upload leaves half a file when cut."""

    def __init__(self, src: BytesIO, dest: str, mode: str):
        super().__init__(src, dest)
        self.mode, self.content = mode, src.getvalue()

    def execute(self, state: State, host: Host, connector_arguments: ConnectorArguments) -> bool:
        connector_arguments.update(self.connector_arguments)
        shown = {"print_output": state.print_output, "print_input": state.print_input}
        written = upload(
            host,
            self.content,
            self.dest,
            mode=self.mode,
            only_if=still_held_test(host),
            shown=shown,
            **connector_arguments,
        )
        if written is None:
            host.log_styled(f"{self.dest} not written: this run no longer holds the host's lock", fg="red")
        return bool(written)


# Tells a guard's refusal from a failed write.
REFUSED = "@@gpufleet:write-refused"


def guarded(command: str, only_if: str | None, cleanup: str = "") -> str:
    """`command` if the shell test `only_if` holds, else `cleanup`, REFUSED and exit 3."""
    if only_if is None:
        return command
    return f"if ! {{ {only_if}; }}; then {cleanup}echo {REFUSED}; exit 3; fi; {command}"


def upload(
    host: Host,
    content: str | bytes,
    path: str,
    *,
    mode: str = "0644",
    only_if: str | None = None,
    secret: bool = False,
    shown: Mapping[str, bool] | None = None,
    **arguments: Any,
) -> bool | None:
    """Replace root-owned `path` (docs/crash-safety.md, "Atomic writes"); None when the test `only_if` refused."""
    shown = dict(shown or {})
    ok, output = host.run_shell_command("umask 077 && mktemp -d", **shown)
    private = output.stdout_lines[-1].strip() if ok and output.stdout_lines else ""
    if not private.startswith("/"):
        host.log_styled(f"could not make a private temp dir: {' | '.join(output.stderr_lines[-2:])}", fg="red")
        return False
    data = content.encode() if isinstance(content, str) else content
    source, check = f"{private}/upload", f"{private}/sha256"
    try:
        if not host.put_file(BytesIO(data), source, **shown):
            return False
        if secret and not host.put_file(as_io(sha256(data)), check, **shown):
            return False
        write = guarded(
            atomic_write_command(
                path,
                mode=mode,
                source=source,
                sha256=None if secret else sha256(data),
                sha256_from=check if secret else None,
            ),
            only_if,
        )
        ok, output = host.run_shell_command(write, **shown, **arguments)
        if not ok and REFUSED in output.stdout_lines:
            return None
        return bool(ok)
    finally:
        host.run_shell_command(f"rm -rf {shlex.quote(private)}", **shown)


def write_file(host: Host, path: str, content: str, mode: str = "0644", only_if: str | None = None) -> bool | None:
    """upload() from a FunctionCommand, for content known only while executing."""
    return upload(host, content, path, mode=mode, only_if=only_if, _sudo=use_sudo(host))


def put_content(path: str, content: str | bytes, mode: str = "644") -> Commands:
    """Make root-owned `path` hold `content`, by the snapshot's sha256."""
    if snapshot().file_sha256.get(path) == sha256(content):
        return
    directory = path.rsplit("/", 1)[0] or "/"
    yield StringCommand("install", "-d", "-m", "755", shlex.quote(directory))
    yield AtomicUpload(as_io(content), path, mode)


def _install_secret(state: State, host: Host, path: str, secret: Hidden) -> bool:
    sudo = use_sudo(host)
    directory = path.rsplit("/", 1)[0]
    ok, output = host.run_shell_command(f"install -d -m 700 -o root -g root {shlex.quote(directory)}", _sudo=sudo)
    if not ok:
        raise RuntimeError(f"could not create {directory}: {output.stderr}")
    written = upload(host, secret.reveal(), path, mode="0600", only_if=still_held_test(host), secret=True, _sudo=sudo)
    if written is None:
        host.log_styled(f"{path} not written: this run no longer holds the host's lock", fg="red")
    elif not written:
        raise RuntimeError(f"could not install {path}")
    return bool(written)


def put_secret(path: str, content: str) -> Commands:
    """Like put_content, for a root-only 0600 file holding secrets."""
    if snapshot().file_sha256.get(path) == sha256(content):
        return
    yield FunctionCommand(_install_secret, (path, Hidden(content)), {})


@operation()
def directories(paths: list[str], user: str = "root", group: str = "root", mode: str = "755") -> Commands:
    """Give `paths` this owner and mode, creating them where missing."""
    wrong = [p for p in paths if snapshot().dirs.get(p) != (user, group, mode.lstrip("0") or "0")]
    if not wrong:
        host.noop(f"{len(paths)} directories exist, {user}:{group} {mode}")
        return
    quoted = [shlex.quote(p) for p in wrong]
    yield StringCommand(
        "install", "-d", "-o", shlex.quote(user), "-g", shlex.quote(group), "-m", shlex.quote(mode), *quoted
    )


@operation()
def prerequisites(packages: tuple[str, ...] = ("ca-certificates", "curl")) -> Commands:
    """Install what fetching the signed repos needs."""
    missing = [p for p in packages if not snapshot().installed(p)]
    if not missing:
        host.noop(", ".join(packages) + " installed")
        return
    yield from apt.packages._inner(packages=missing, update=True, no_recommends=True)
