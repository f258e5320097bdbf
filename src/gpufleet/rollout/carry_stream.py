"""The carry's tar stream, relayed by the controller from the canary to a host and checked by three sha256s."""

from __future__ import annotations

import hashlib
import posixpath
import re
import shlex
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import paramiko

from gpufleet.remote.ssh import needs_sudo
from gpufleet.remote.transport import SshTransport, TransportError

SCRIPTS = Path(__file__).resolve().parents[1] / "data" / "carry"
SEND, RECEIVE, PLACE = ((SCRIPTS / f"{name}.sh").read_text() for name in ("send", "receive", "place"))
STREAM_CHUNK = 256 * 1024
STREAM_TIMEOUT_S = 120.0  # per read or write on a channel


def _root(client: paramiko.SSHClient, command: str) -> str:
    return f"sudo -n sh -c {shlex.quote(command)}" if needs_sudo(client) else f"sh -c {shlex.quote(command)}"


def _open(transport: SshTransport, command: str) -> paramiko.Channel:
    session = transport.client.get_transport()
    if session is None or not session.is_active():
        raise TransportError(f"{transport.name}: SSH session closed")
    channel = session.open_session()
    channel.settimeout(STREAM_TIMEOUT_S)
    channel.exec_command(_root(transport.client, command))
    return channel


def _drain_stderr(channel: paramiko.Channel, into: list[bytes]) -> None:
    while channel.recv_stderr_ready():
        into.append(channel.recv_stderr(65536))


def relay(
    source: SshTransport,
    source_cmd: str,
    source_input: bytes,
    target: SshTransport,
    target_cmd: str,
    tamper: Callable[[bytes], bytes] | None = None,
    deadline: float | None = None,
) -> tuple[int, str, str, str]:
    """Stream source_cmd's stdout into target_cmd's stdin: (bytes, sha256, source's stderr, target's stderr).
    Raises TransportError past deadline (time.monotonic())."""
    src = _open(source, source_cmd)
    dst = _open(target, target_cmd)
    src_err: list[bytes] = []
    dst_err: list[bytes] = []
    sha256 = hashlib.sha256()
    total = 0

    def feed() -> None:  # in a thread: tar writes while it still reads its list
        try:
            src.sendall(source_input)
            src.shutdown_write()
        except OSError:
            pass  # the source's exit status and stderr say why

    writer = threading.Thread(target=feed, daemon=True)
    try:
        writer.start()
        while True:
            chunk = src.recv(STREAM_CHUNK)
            if not chunk:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TransportError(f"{target.name}: the carry passed its time limit after {total} bytes")
            sha256.update(chunk)
            total += len(chunk)
            dst.sendall(tamper(chunk) if tamper else chunk)
            _drain_stderr(src, src_err)
            _drain_stderr(dst, dst_err)
        dst.shutdown_write()
        writer.join(STREAM_TIMEOUT_S)
        for channel, into in ((src, src_err), (dst, dst_err)):
            while chunk := channel.recv_stderr(65536):
                into.append(chunk)
            channel.recv_exit_status()
    finally:
        src.close()
        dst.close()
    return (
        total,
        sha256.hexdigest(),
        b"".join(src_err).decode(errors="replace"),
        b"".join(dst_err).decode(errors="replace"),
    )


def send_command(directory: str) -> str:
    """On the canary: tar the NUL-separated paths on stdin to stdout."""
    return _script(SEND, directory)


def receive_command(directory: str, tmp: str) -> str:
    """On the host: unpack the stream into tmp, a new root-only dir beside the cache dir."""
    return _script(RECEIVE, tmp, _stale_prefix(directory))


def place_command(directory: str, tmp: str, roots: Sequence[str]) -> str:
    """Rename each unpacked root into the cache dir unless the host has it by now."""
    return _script(PLACE, directory, tmp, *roots)


def _script(script: str, *args: str) -> str:
    return f"set -- {' '.join(map(shlex.quote, args))}\n{script}"


def _stale_prefix(directory: str) -> str:
    parent, name = posixpath.split(directory.rstrip("/"))
    return posixpath.join(parent or "/", f".{name}.gpufleet-carry-")


def temp_dir(directory: str) -> str:
    return _stale_prefix(directory) + uuid.uuid4().hex[:12]


SHA_LINE = re.compile(r"^([0-9a-f]{64})\s+-$", re.MULTILINE)
RC_LINE = re.compile(r"^tar-rc (\d+)$", re.MULTILINE)


def stream_problem(sent: str, relayed: str, received: str) -> str | None:
    """None when both tars ended well and all three sha256 agree."""
    problems = []
    for who, text in (("canary", sent), ("host", received)):
        rc = RC_LINE.search(text)
        if rc is None or rc.group(1) != "0":
            problems.append(f"tar on the {who} failed ({_last_line(text, 'no exit status')})")
    sha_sent, sha_received = SHA_LINE.search(sent), SHA_LINE.search(received)
    if sha_sent is None or sha_received is None:
        problems.append("a checksum is missing")
    elif not (sha_sent.group(1) == relayed == sha_received.group(1)):
        problems.append(
            f"checksum mismatch (canary {sha_sent.group(1)[:12]}, relayed {relayed[:12]}, host "
            f"{sha_received.group(1)[:12]})"
        )
    return "; ".join(problems) or None


def _last_line(text: str, default: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if not RC_LINE.match(ln) and not SHA_LINE.match(ln)]
    return lines[-1][:160] if lines else default
