"""How the health checks reach a vLLM server: HTTP to 127.0.0.1:<port> *on the host*, plus the container's state.

Two transports share one small interface so every check runs unchanged through SSH (production) and on loopback
(tests against a real vLLM process):

- SshTransport: HTTP rides a paramiko ``direct-tcpip`` channel to 127.0.0.1:<port> on the host, so the server's
  port never has to be reachable from the operator's network; container state comes from ``docker ps``/``inspect``
  over the same SSH connection (containers have no name: they are found by their ``gpufleet.<service>`` label).
- The tests' LoopbackTransport (tests/loopback.py, test-only): HTTP to a local port; the "container" is the server
  process and its liveness.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import json
import logging
import re
import shlex
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import paramiko

from gpufleet.names import LOOPBACK, container_label_key

# What one HTTP answer may total: a 1 MiB body (vLLM's /metrics and /v1/models are tens of KiB), its headers, and
# one read-ahead buffer. Past it the answer is a finding, not a read of whatever the server cares to send.
MAX_BODY_BYTES = 1 << 20
MAX_ANSWER_BYTES = MAX_BODY_BYTES + (64 << 10) + io.DEFAULT_BUFFER_SIZE
EVIDENCE_BYTES = 80  # first bytes of an answer kept to quote when it is not HTTP


class RefusedTunnelRecords(logging.Filter):
    """Drops paramiko's ERROR record for a tunnel sshd could not connect ("Secsh channel 23 open FAILED: Connection
    refused: Connect failed"): SshTransport.http raises it as ConnectionRefusedError or ConnectionResetError, which
    the checks report per host in their own words. A server still loading refuses many times while a deploy waits
    for it; the records would print among the deploy's lines as errors. paramiko's other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Secsh channel ") and " open FAILED: " in message)


_REFUSED_TUNNEL_RECORDS = RefusedTunnelRecords()


class TransportError(Exception):
    """The transport itself failed (SSH down, command failed): nothing can be said about the server."""


class Unreachable(TransportError):
    """The host cannot be reached over SSH."""


@dataclass(frozen=True)
class ContainerInfo:
    """What docker (or the local process table) says about the server's container."""

    id: str
    state: str  # docker's State.Status: running, exited, restarting, created, paused, dead
    started_at: float | None = None  # epoch seconds
    exit_code: int | None = None
    image: str | None = None  # the ref it was started from
    image_id: str | None = None  # sha256:... of the image actually running
    spec_hash: str | None = None  # value of the gpufleet.<service> label
    model: str | None = None  # the gpufleet.<service>.model label: the model's commit (repo@commit) it runs
    # Its own IP address on its docker network (None: host networking, or not known). The checks reach the server
    # there, inside the container's network namespace: what answers is this container, never a local user's
    # listener that bound the published port first (it would get the API key and could fake readiness).
    address: str | None = None

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def image_short(self) -> str | None:
        """12 hex digits: the registry digest when the container was started by digest (as the deploy pins it),
        else the local image id."""
        source = self.image.rsplit("@", 1)[1] if self.image and "@" in self.image else self.image_id
        return source.split(":", 1)[-1][:12] if source else None


class Transport(Protocol):
    name: str

    def http(self, port: int, timeout: float, max_bytes: int = MAX_ANSWER_BYTES,
             address: str = LOOPBACK) -> DeadlineHTTPConnection:  # fmt: skip
        """A connected, single-use HTTP connection to address:port on the host (the loopback by default).

        timeout: one deadline, from this call, for connecting and for the whole answer. max_bytes: what the
        answer may total (status line, headers, body). Raises ConnectionRefusedError when nothing listens there,
        Unreachable when the host is unreachable, TimeoutError when the connect does not finish in time.
        """

    def container(self, service: str) -> ContainerInfo | None:
        """The service's container (the running one, else the newest), or None when there is none."""

    def logs(self, service: str, tail: int = 30) -> list[str]:
        """The container's last log lines (stdout and stderr)."""


class _DeadlineReader(io.RawIOBase):
    """The response side of a _DeadlineSocket as a raw stream, so io.BufferedReader can wrap it (http.client needs
    peek() for chunked bodies, which paramiko's own ChannelFile lacks)."""

    def __init__(self, sock: _DeadlineSocket):
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._sock.recv(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._sock.reader_closed()
        super().close()


class _DeadlineSocket:
    """The socket surface http.client uses, over a socket or a paramiko Channel (both have recv/sendall/
    settimeout/close), with one deadline for the whole exchange and a cap on the bytes read.

    A per-read socket timeout would let a server that drips a byte per read hold a request for ever; here every
    read gets only what is left of the request's time. The cap bounds memory for whatever the server sends
    (headers included: http.client alone allows 100 header lines of 64 KiB each).
    """

    def __init__(self, raw: Any, deadline: float, timeout: float, max_bytes: int):
        self._raw, self._deadline, self._timeout, self._max_bytes = raw, deadline, timeout, max_bytes
        self.received = 0
        self.head = b""  # the first bytes of the answer: evidence when it is not HTTP
        self._readers = 0
        self._closed = False

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            got = f"{self.received} bytes" if self.received else "nothing"
            raise DeadlineExceeded(f"no complete answer within {self._timeout:g} s ({got} received)", self.head)
        self._raw.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self._arm()
        try:
            self._raw.sendall(data)
        except TimeoutError:
            self._arm()  # the deadline passed meanwhile: say so
            raise

    def recv(self, size: int) -> bytes:
        if self.received >= self._max_bytes:
            raise AnswerTooLarge(f"answer over {self._max_bytes} bytes", self.head)
        self._arm()
        try:
            data = self._raw.recv(min(size, self._max_bytes - self.received))
        except TimeoutError:
            self._arm()  # the deadline passed during the read: say so, with what did arrive
            raise
        self.received += len(data)
        if len(self.head) < EVIDENCE_BYTES:
            self.head += data[: EVIDENCE_BYTES - len(self.head)]
        return data

    def settimeout(self, timeout: float | None) -> None:
        """Ignored: the deadline decides every read's timeout."""

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self))

    def reader_closed(self) -> None:
        self._readers -= 1
        if self._closed and self._readers <= 0:
            self._raw.close()

    def close(self) -> None:
        # A "Connection: close" response takes the connection over and still reads its body after http.client
        # closed the connection: like a socket's makefile(), an open reader keeps the stream alive.
        self._closed = True
        if self._readers <= 0:
            self._raw.close()


class DeadlineHTTPConnection(http.client.HTTPConnection):
    """http.client over an already-connected socket or channel: connect, headers and body share one deadline.

    Single use: http.client must not dial anything itself (over SSH there is nothing it could dial).
    """

    def __init__(self, raw: Any, port: int, timeout: float, deadline: float, max_bytes: int):
        super().__init__("127.0.0.1", port, timeout=timeout)
        # Kept after http.client lets go of the socket: how much arrived, and its first bytes.
        self.wire = self.sock = _DeadlineSocket(raw, deadline, timeout, max_bytes)

    def connect(self) -> None:
        if self.sock is None:
            raise ConnectionError("the connection was used for one request and closed")


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before its answer was complete. head: the first bytes that did arrive."""

    def __init__(self, message: str, head: bytes = b""):
        super().__init__(message)
        self.head = head


class BadAnswer(Exception):
    """Something answered, but not with a usable HTTP answer. str(): one line with the evidence."""


class AnswerTooLarge(BadAnswer):
    """The server sent more than the request allows (see MAX_ANSWER_BYTES)."""

    def __init__(self, message: str, head: bytes = b""):
        super().__init__(message)
        self.head = head


def pick_container(inspected: Iterable[dict[str, Any]], label: str) -> ContainerInfo | None:
    """From `docker inspect` JSON objects pick the running container, else the newest one."""
    infos = [_from_inspect(obj, label) for obj in inspected]
    if not infos:
        return None
    running = [i for i in infos if i.running]
    return running[0] if running else max(infos, key=lambda i: i.started_at or 0.0)


def _from_inspect(obj: dict[str, Any], label: str) -> ContainerInfo:
    state = obj.get("State") or {}
    config = obj.get("Config") or {}
    return ContainerInfo(
        id=obj.get("Id", "")[:12],
        state=state.get("Status", "unknown"),
        started_at=_parse_docker_time(state.get("StartedAt")),
        exit_code=state.get("ExitCode"),
        image=config.get("Image"),
        image_id=obj.get("Image"),
        spec_hash=(config.get("Labels") or {}).get(label),
        model=(config.get("Labels") or {}).get(f"{label}.model"),
        address=_network_address(obj.get("NetworkSettings")),
    )


def _network_address(settings: object) -> str | None:
    """The container's first IP address on its docker networks (bridge or user-defined), else None."""
    networks = settings.get("Networks") if isinstance(settings, dict) else None
    for network in (networks or {}).values() if isinstance(networks, dict) else ():
        address = network.get("IPAddress") if isinstance(network, dict) else None
        if isinstance(address, str) and address:
            try:
                return str(ipaddress.ip_address(address))
            except ValueError:
                continue
    return None


def _parse_docker_time(text: str | None) -> float | None:
    # Docker writes RFC 3339 with nanoseconds ("2026-11-29T21:02:31.123456789Z"); "0001-01-01..." = never started.
    if not text or text.startswith("0001-"):
        return None
    m = re.fullmatch(r"(.+T\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)?", text)
    if m is None:
        return None
    base, frac, tz = m.groups()
    # datetime takes at most microseconds; docker gives nanoseconds.
    stamp = datetime.fromisoformat(f"{base}.{(frac or '0')[:6].ljust(6, '0')}{'+00:00' if tz in (None, 'Z') else tz}")
    return stamp.timestamp()


class SshTransport:
    """Checks through an open paramiko.SSHClient. sudo must not prompt (the deploy user has NOPASSWD).

    Open one as the deploy does (pyinfra's connector, the inventory's SSH settings) with transport_from_pyinfra_host
    or gpufleet.remote.ssh.open_ssh:

    >>> check(open_ssh("gpu1", {"ssh_user": "deploy"}), expected)
    """

    def __init__(self, client: paramiko.SSHClient, name: str | None = None, sudo: bool = True):
        self.client = client
        self.name = name or _peer_name(client)
        self._sudo = "sudo -n " if sudo else ""
        # On paramiko's logger itself (a logger's filters see only its own records; pyinfra's handlers sit above
        # it); added once, by the only code that opens these tunnels.
        logging.getLogger("paramiko.transport").addFilter(_REFUSED_TUNNEL_RECORDS)

    def _transport(self) -> paramiko.Transport:
        t = self.client.get_transport()
        if t is None or not t.is_active():
            raise Unreachable(f"{self.name}: SSH connection is not open")
        return t

    def http(self, port: int, timeout: float, max_bytes: int = MAX_ANSWER_BYTES,
             address: str = LOOPBACK) -> DeadlineHTTPConnection:  # fmt: skip
        deadline = time.monotonic() + timeout
        try:
            chan = self._transport().open_channel("direct-tcpip", (address, port), (LOOPBACK, 0), timeout=timeout)
        except paramiko.ChannelException as e:
            # sshd answers "Connect failed" (code 2) when its own connect() to address:port fails, with the
            # reason as text: refused, or reset (a listener that accepted and dropped it at once, as a proxy in
            # front of a server still loading may: the same as a reset seen without the tunnel).
            if e.code == paramiko.common.OPEN_FAILED_CONNECT_FAILED:
                if "reset" in (e.text or "").lower():
                    raise ConnectionResetError(f"{self.name}: {address}:{port} reset the connection") from e
                raise ConnectionRefusedError(f"{self.name}: {address}:{port} refused the connection") from e
            raise TransportError(f"{self.name}: sshd refused the tunnel to port {port}: {e.text}") from e
        except (paramiko.SSHException, OSError, EOFError) as e:
            if time.monotonic() >= deadline:  # paramiko says "Unable to open channel." for its own timeout
                raise TimeoutError(f"{self.name}: the tunnel to port {port} did not open within {timeout:g} s") from e
            raise Unreachable(f"{self.name}: SSH failed: {e}") from e
        return DeadlineHTTPConnection(chan, port, timeout, deadline, max_bytes)

    def run(self, command: str, timeout: float = 30.0) -> tuple[int, str, str]:
        """Run a shell command on the host: (exit status, stdout, stderr)."""
        self._transport()  # a closed client has no transport: say "unreachable", not AttributeError
        try:
            _, out, err = self.client.exec_command(command, timeout=timeout)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
            return out.channel.recv_exit_status(), stdout, stderr
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise Unreachable(f"{self.name}: SSH failed: {e}") from e

    def container(self, service: str) -> ContainerInfo | None:
        label = container_label_key(service)
        ids = f"$({self._sudo}docker ps -aq --filter label={shlex.quote(label)})"
        # One round trip: list by label, inspect what was found (inspect with no ids would fail). A failing
        # `docker ps` (daemon down, no sudo) must fail the command, not read as "no container".
        cmd = f'ids={ids} || exit $?; if [ -z "$ids" ]; then echo "[]"; else {self._sudo}docker inspect $ids; fi'
        rc, out, err = self.run(cmd)
        if rc != 0:
            raise TransportError(f"{self.name}: docker inspect failed: {(err or out).strip()[:200]}")
        try:
            return pick_container(json.loads(out or "[]"), label)
        except (ValueError, TypeError, AttributeError) as e:  # not JSON, or not docker inspect's list of objects
            raise TransportError(f"{self.name}: unexpected docker inspect output: {out.strip()[:120]!r}") from e

    def logs(self, service: str, tail: int = 30) -> list[str]:
        info = self.container(service)
        if info is None:
            return []
        status, out, err = self.run(f"{self._sudo}docker logs --tail {int(tail)} {shlex.quote(info.id)} 2>&1")
        # A --rm container gone between the two commands: docker's "No such container" is not its log (the
        # caller then reads the unit's journal, which has the container's output).
        return (out + err).splitlines()[-tail:] if status == 0 else []


def _peer_name(client: paramiko.SSHClient) -> str:
    t = client.get_transport()
    try:
        return str(t.getpeername()[0]) if t else "?"
    except OSError:
        return "?"


__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_BODY_BYTES",
    "AnswerTooLarge",
    "BadAnswer",
    "ContainerInfo",
    "DeadlineExceeded",
    "DeadlineHTTPConnection",
    "SshTransport",
    "Transport",
    "TransportError",
    "Unreachable",
    "pick_container",
]
