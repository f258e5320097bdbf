"""A free TCP port on loopback, for servers the tests start (vLLM, sshd, stand-ins) and for refused-connection cases.

Ports come from a block of this process's own, below the kernel's ephemeral range (32768-60999): under pytest-xdist
another worker's server, or any outgoing connection's source port, never takes a port between our check and our
server's bind, and a port that must refuse connections is not answered by another worker's server meanwhile.
"""

from __future__ import annotations

import itertools
import os
import socket

FIRST_PORT = 20000  # blocks of 1000 from here: 20000-20999 for a run without workers, gw<n>: 21000 + 1000 n
BLOCK = 1000
MAX_WORKERS = 12  # keeps the blocks (up to 32999) clear of the ephemeral range


def _block_start() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...; unset without xdist
    n = int(worker.removeprefix("gw")) + 1 if worker else 0
    if n > MAX_WORKERS:
        raise RuntimeError(f"tests/ports.py has port blocks for {MAX_WORKERS} xdist workers, not {n}: run fewer (-n)")
    return FIRST_PORT + BLOCK * n


# Each call moves on, so two servers of this process never get the same port; the block start comes from
# the environment of the process that first asks (a worker's PYTEST_XDIST_WORKER is set before tests import this).
_offsets = itertools.count(os.getpid() % BLOCK)


def free_port() -> int:
    start = _block_start()
    for _ in range(BLOCK):
        port = start + next(_offsets) % BLOCK
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or in TIME_WAIT): the next one
            return port
    raise RuntimeError(f"no free loopback port in {start}-{start + BLOCK - 1}")
