"""The stand-in's multi-node engine (`--nnodes N`), as vLLM 0.32's multiprocessing executor behaves across hosts.

The head's store listens from its start and its API once every rank joined; a headless rank serves nothing.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING or __package__:
    from .vllm_argv import VERSION, fail
else:  # the image runs it as a script beside its modules
    from vllm_argv import VERSION, fail


class Head:
    """Rank 0's side: the store the ranks join, and whether each one is still there."""

    def __init__(self, port: int, nnodes: int):
        self.expected = set(range(1, nnodes))
        self.ranks: dict[int, socket.socket] = {}
        self.late: list[socket.socket] = []  # held, as the store holds them, but never in the group
        self.lock = threading.Lock()
        self.joined = threading.Event()
        server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False)
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=self._hello, args=(conn,), daemon=True).start()

    def _hello(self, conn: socket.socket) -> None:
        words = conn.makefile("r").readline().split()
        rank = int(words[1]) if len(words) == 2 and words[0] == "rank" and words[1].isdigit() else None
        with self.lock:
            # torch's world is set: a rank that comes back never joins again.
            if rank not in self.expected or rank in self.ranks or self.joined.is_set():
                self.late.append(conn)
                return
            self.ranks[rank] = conn
            print(f"INFO rank {rank} joined the process group ({len(self.ranks)} of {len(self.expected)})", flush=True)
            if set(self.ranks) == self.expected:
                self.joined.set()

    def wait(self, timeout_s: float) -> None:
        """Until every rank joined; vLLM's TimeoutError (exit 1) past timeout_s."""
        if not self.joined.wait(timeout_s):
            missing = sorted(self.expected - set(self.ranks))
            fail(
                1,
                f"TimeoutError: Timed out waiting for engine core processes to start (ranks {missing} never "
                f"joined). Waited {timeout_s:g}s (configured by VLLM_ENGINE_READY_TIMEOUT_S).",
            )

    def lost(self) -> list[int]:
        """The ranks whose connection closed."""
        gone = []
        with self.lock:
            for rank, conn in self.ranks.items():
                try:
                    if conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                        gone.append(rank)
                except BlockingIOError:
                    continue
                except OSError:
                    gone.append(rank)
        return gone


def ready_timeout_s() -> float:
    return float(os.environ.get("VLLM_ENGINE_READY_TIMEOUT_S", "600"))


def run_rank(master_addr: str, master_port: int, rank: int) -> int:
    """A headless rank: join the head's store, then hold the connection until SIGTERM."""
    print(
        f"INFO Launching vLLM (v{VERSION}) headless multiproc executor, with head node address "
        f"{master_addr}:{master_port} for torch.distributed process group.",
        flush=True,
    )
    timeout_s = float(os.environ.get("STANDIN_JOIN_TIMEOUT_S", "1800"))  # torch's process-group timeout
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((master_addr, master_port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                fail(
                    1,
                    f"torch.distributed.DistStoreError: Timed out after {timeout_s:g} seconds waiting to "
                    f"connect to the store at {master_addr}:{master_port}",
                )
            time.sleep(1)
    conn.sendall(f"rank {rank}\n".encode())
    print(f"INFO rank {rank} joined the head at {master_addr}:{master_port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        conn.close()
    return 0
