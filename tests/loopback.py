"""LoopbackTransport: the health checks against a vLLM process on this machine (the vllm tier's real servers,
the stand-in server's unit tests). A test transport: production reaches hosts through SSH only.

The process stands in for the container: running while the process lives, "exited" (with its exit code when it
is our child) once it is gone.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from gpufleet.remote.transport import LOOPBACK, MAX_ANSWER_BYTES, ContainerInfo, DeadlineHTTPConnection


class LoopbackTransport:
    """A vLLM process on this machine: HTTP on 127.0.0.1, the process stands in for the container.

    process: a subprocess.Popen (preferred: its exit code is known) or a PID; None = assume it runs.
    log_path: the server's combined output, for logs().
    """

    def __init__(
        self,
        process: subprocess.Popen | int | None = None,
        log_path: Path | None = None,
        host: str = "127.0.0.1",
        name: str = "localhost",
    ):
        self.process, self.log_path, self.host, self.name = process, log_path, host, name

    def http(self, port: int, timeout: float, max_bytes: int = MAX_ANSWER_BYTES,
             address: str = LOOPBACK) -> DeadlineHTTPConnection:  # fmt: skip
        deadline = time.monotonic() + timeout
        # Raises ConnectionRefusedError while the server is loading (it does not listen yet).
        sock = socket.create_connection((self.host if address == LOOPBACK else address, port), timeout=timeout)
        return DeadlineHTTPConnection(sock, port, timeout, deadline, max_bytes)

    def container(self, service: str) -> ContainerInfo | None:
        if self.process is None:
            return ContainerInfo(id="local", state="running")
        pid = self.process if isinstance(self.process, int) else self.process.pid
        exit_code = self.process.poll() if isinstance(self.process, subprocess.Popen) else None
        alive = exit_code is None and _pid_alive(pid)
        return ContainerInfo(
            id=str(pid),
            state="running" if alive else "exited",
            started_at=_pid_start_time(pid) if alive else None,
            exit_code=exit_code,
        )

    def logs(self, service: str, tail: int = 30) -> list[str]:
        if self.log_path is None or not self.log_path.exists():
            return []
        return self.log_path.read_text(errors="replace").splitlines()[-tail:]


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent has not reaped it yet


def _pid_start_time(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, in clock ticks since boot
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")
