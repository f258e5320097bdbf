"""The carry's stream over the rollout's own SSH sessions: the controller relays `tar` from the canary to a host
(hosts need no SSH to each other). The canary hashes what it sends, the controller what it relays, the host what it
receives (sha256 each); the host unpacks into a temp dir beside its cache dir, and only when all three agree are the
entries renamed into place, never over one the host has."""

from __future__ import annotations

import hashlib
import posixpath
import re
import shlex
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import paramiko

from gpufleet.remote.ssh import needs_sudo
from gpufleet.remote.transport import SshTransport, TransportError

STREAM_CHUNK = 256 * 1024
STREAM_TIMEOUT_S = 120.0  # per read or write on a channel: a host that stops answering ends the carry to it


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


def relay(source: SshTransport, source_cmd: str, source_input: bytes, target: SshTransport, target_cmd: str,
          tamper: Callable[[bytes], bytes] | None = None, deadline: float | None = None) -> tuple[int, str, str, str]:
    """source_cmd's stdout streamed into target_cmd's stdin through this process: (bytes relayed, its sha256,
    source's stderr, target's stderr). tamper: for tests, what the bytes become between the two ends. deadline
    (time.monotonic()): past it, TransportError."""
    src = _open(source, source_cmd)
    dst = _open(target, target_cmd)
    src_err: list[bytes] = []
    dst_err: list[bytes] = []
    digest = hashlib.sha256()
    total = 0
    def feed() -> None:  # beside the reading below: tar writes while it still reads its list
        try:
            src.sendall(source_input)
            src.shutdown_write()
        except OSError:
            pass  # the source ended early: its exit status and stderr say why

    writer = threading.Thread(target=feed, daemon=True)
    try:
        writer.start()
        while True:
            chunk = src.recv(STREAM_CHUNK)
            if not chunk:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TransportError(f"{target.name}: the carry passed its time limit after {total} bytes")
            digest.update(chunk)
            total += len(chunk)
            dst.sendall(tamper(chunk) if tamper else chunk)
            _drain_stderr(src, src_err)
            _drain_stderr(dst, dst_err)
        dst.shutdown_write()
        writer.join(STREAM_TIMEOUT_S)
        for channel, into in ((src, src_err), (dst, dst_err)):  # the rest of each end's stderr, to its EOF
            while chunk := channel.recv_stderr(65536):
                into.append(chunk)
            channel.recv_exit_status()
    finally:
        src.close()
        dst.close()
    return total, digest.hexdigest(), b"".join(src_err).decode(errors="replace"), \
        b"".join(dst_err).decode(errors="replace")


def send_command(directory: str) -> str:
    """On the canary: tar the NUL-separated relative paths read from stdin, to stdout; its sha256 and tar's exit
    status to stderr."""
    d = shlex.quote(directory)
    return (f"cd {d} && {{ {{ tar --null -T - -cf -; echo \"tar-rc $?\" >&2; }} | tee /dev/fd/3 | sha256sum >&2; }} "
            "3>&1")


NOT_PLAIN = 90  # the host's `tar-rc` for a member that is not a regular file or directory, or a hard link


def receive_command(directory: str, tmp: str) -> str:
    """On the host: the stream unpacked into tmp (a new root-only dir beside the cache dir), its sha256 and tar's
    exit status to stderr. No owner or mode comes from the stream; anything but regular files and directories
    refuses it whole. Temp dirs a killed carry left go first (under the host's lock); a cut stream removes its own."""
    bad = 'find "$t" -mindepth 1 \\( \\( ! -type f ! -type d \\) -o \\( -type f -links +1 \\) \\) -print -quit'
    return (f"trap '' HUP PIPE; t={shlex.quote(tmp)}; rm -rf {shlex.quote(_stale_prefix(directory))}*; "
            'mkdir -m 700 "$t" && { { tee /dev/fd/4 | sha256sum >&2; } 4>&1 | '
            'tar -C "$t" --no-same-owner --no-same-permissions -xf -; rc=$?; '
            f'if [ $rc = 0 ]; then b=$({bad}); if [ -n "$b" ]; then '
            f'echo "not a regular file or directory: ${{b#"$t"/}}" >&2; rc={NOT_PLAIN}; else '
            'chmod -R u=rwX,go=rX,a-st "$t" && chmod 700 "$t" || rc=$?; fi; fi; '
            '[ $rc = 0 ] || rm -rf "$t"; echo "tar-rc $rc" >&2; }')


def place_command(directory: str, tmp: str, roots: Sequence[str]) -> str:
    """Each unpacked root renamed into the cache dir unless the host has it by now; the temp dir removed. A root's
    parent is reached one directory at a time, never through a link (the container may have planted one to /etc),
    must resolve inside the cache dir, and the rename is made from inside it."""
    d, t = shlex.quote(directory), shlex.quote(tmp)
    place = ('place() { ( cd -P -- "$d" || exit 1; set -f; IFS=/; '
             'case "$1" in */*) parent=${1%/*};; *) parent=;; esac; '
             'for c in $parent; do if [ -L "$c" ] || { [ -e "$c" ] && [ ! -d "$c" ]; }; then '
             'echo "refused $1: $c is not a directory"; exit 0; fi; '
             '[ -d "$c" ] || mkdir -m 755 -- "$c" || exit 1; cd -P -- "$c" || exit 1; done; '
             'case "$(pwd -P)/" in "$real"/*) ;; *) echo "refused $1: it leads out of the cache dir"; exit 0;; esac; '
             'name=${1##*/}; if [ -e "$name" ] || [ -L "$name" ]; then echo "present $1"; '
             'else mv -T -- "$t/$1" "$name" && echo "placed $1"; fi ); }')
    steps = [f"trap '' HUP PIPE; d={d}; t={t}; mkdir -p \"$d\" && real=$(cd -P -- \"$d\" && pwd -P) || exit 1",
             place, *(f"place {shlex.quote(r)} || ok=1" for r in roots), 'rm -rf "$t"; exit ${ok:-0}']
    return "; ".join(steps)


def _stale_prefix(directory: str) -> str:
    parent, name = posixpath.split(directory.rstrip("/"))
    return posixpath.join(parent or "/", f".{name}.gpufleet-carry-")


def temp_dir(directory: str) -> str:
    return _stale_prefix(directory) + uuid.uuid4().hex[:12]


SHA_LINE = re.compile(r"^([0-9a-f]{64})\s+-$", re.MULTILINE)
RC_LINE = re.compile(r"^tar-rc (\d+)$", re.MULTILINE)


def stream_problem(sent: str, relayed: str, received: str) -> str | None:
    """The three ends' view of one tar stream (each `sha256sum` output, `tar-rc N` lines included for the two
    hosts): None when the canary's tar and the host's untar ended well and all three sha256 agree."""
    problems = []
    for who, text in (("canary", sent), ("host", received)):
        rc = RC_LINE.search(text)
        if rc is None or rc.group(1) != "0":
            problems.append(f"tar on the {who} failed ({_last_line(text, 'no exit status')})")
    sha_sent, sha_received = SHA_LINE.search(sent), SHA_LINE.search(received)
    if sha_sent is None or sha_received is None:
        problems.append("a checksum is missing")
    elif not (sha_sent.group(1) == relayed == sha_received.group(1)):
        problems.append(f"checksum mismatch (canary {sha_sent.group(1)[:12]}, relayed {relayed[:12]}, host "
                        f"{sha_received.group(1)[:12]})")
    return "; ".join(problems) or None


def _last_line(text: str, default: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if not RC_LINE.match(ln) and not SHA_LINE.match(ln)]
    return lines[-1][:160] if lines else default
