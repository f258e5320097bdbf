"""Run commands and own processes by PID: the sandbox only ever stops what it started itself."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

from gpufleet.errors import GpufleetError

log = logging.getLogger("gpufleet.sandbox")
T = TypeVar("T")


class SandboxError(GpufleetError, RuntimeError):
    """A sandbox step failed; the message is one line a user can act on."""


@overload
def run(argv: Sequence[str], *, check: bool = True, input: bytes, **kw: Any) -> subprocess.CompletedProcess[bytes]: ...
@overload
def run(
    argv: Sequence[str], *, check: bool = True, input: str | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]: ...


def run(
    argv: Sequence[str], *, check: bool = True, input: str | bytes | None = None, **kw: Any
) -> subprocess.CompletedProcess[Any]:
    """Run argv, capturing output; raises SandboxError with the command and its stderr tail."""
    text = not isinstance(input, bytes)
    # stdin is /dev/null so a tool never eats the user's input meant for the next command.
    stdin = {"input": input} if input is not None else {"stdin": subprocess.DEVNULL}
    proc = subprocess.run(list(argv), capture_output=True, text=text, **stdin, **kw)
    if check and proc.returncode != 0:
        err = proc.stderr if text else proc.stderr.decode(errors="replace")
        tail = " | ".join(err.strip().splitlines()[-3:])
        raise SandboxError(f"{' '.join(map(str, argv))[:200]} failed (rc={proc.returncode}): {tail}")
    return proc


def spawn(argv: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None) -> int:
    """Start a daemon in its own session, out of the caller's Ctrl-C; return its PID."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
    return proc.pid


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours still answers kill(0); reap it so it reads as gone.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return _state(pid) not in ("Z", "X", None)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """Kernel start time of a PID, so a recycled PID is never mistaken for ours."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def stop(pid: int | None, grace: float = 30.0, started: str | None = None) -> None:
    """SIGTERM one PID we started, then after `grace` s SIGKILL it and its direct children."""
    if pid is None or not alive(pid) or (started and start_time(pid) != started):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not alive(pid):
            return
        time.sleep(0.1)
    kids = [int(p) for p in run(["ps", "-o", "pid=", "--ppid", str(pid)], check=False).stdout.split()]
    for p in [pid, *kids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    for _ in range(50):
        if not alive(pid):
            return
        time.sleep(0.1)


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll predicate() until truthy; raises SandboxError naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SandboxError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
