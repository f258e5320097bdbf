"""The stand-in vLLM across hosts (--nnodes), on loopback: a headless rank waits for its head, the head serves only
once every rank joined and gives up after VLLM_ENGINE_READY_TIMEOUT_S, neither notices the other die while idle (as
vLLM 0.32, measured: docs/multi-node.md), and a request with a rank gone kills the head's engine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpufleet import sandbox
from gpufleet.sandbox.image import write_tiny_model
from tests.ports import free_port

SERVE = Path(sandbox.__file__).parent / "standin" / "vllm_serve.py"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models") / "tiny"
    write_tiny_model(d)
    return d


def start(model: Path, master_port: int, rank: int, *args: str, env: dict | None = None) -> subprocess.Popen:
    flags = [
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master_port),
        *(["--headless"] if rank else []),
        *args,
    ]
    return subprocess.Popen(
        [sys.executable, str(SERVE), "serve", str(model), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "STANDIN_LOAD_SECONDS": "0", **(env or {})},
    )


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None  # refused: nothing listens (loading, waiting for its ranks, or gone)


def chat(port: int) -> int:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", body, {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def wait_until(test, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not test():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.05)


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=10)


def test_the_head_serves_once_its_rank_joined_and_the_rank_serves_nothing(model, procs):
    port, master = free_port(), free_port()
    head = start(model, master, 0, "--port", str(port), "--served-model-name", "tiny")
    procs.append(head)
    # Listening on the master port, its API still closed: it waits for the rank.
    wait_until(lambda: listening(master))
    time.sleep(0.5)
    assert health(port) is None
    rank = start(model, master, 1)
    procs.append(rank)
    wait_until(lambda: health(port) == 200)
    assert chat(port) == 200
    rank.terminate()
    out, _ = rank.communicate(timeout=10)
    assert rank.returncode == 0
    assert f"headless multiproc executor, with head node address 127.0.0.1:{master}" in out
    assert "rank 1 joined the head" in out


def test_a_rank_that_waits_for_its_head_joins_it_when_it_comes(model, procs):
    port, master = free_port(), free_port()
    procs.append(start(model, master, 1))  # first: it retries until the head listens
    time.sleep(1.5)
    procs.append(start(model, master, 0, "--port", str(port), "--served-model-name", "tiny"))
    wait_until(lambda: health(port) == 200)


def test_a_rank_gone_while_idle_goes_unnoticed_until_a_request_kills_the_heads_engine(model, procs):
    port, master = free_port(), free_port()
    head = start(model, master, 0, "--port", str(port), "--served-model-name", "tiny")
    rank = start(model, master, 1)
    procs += [head, rank]
    wait_until(lambda: health(port) == 200)
    rank.kill()
    rank.communicate(timeout=10)
    time.sleep(1)
    assert health(port) == 200  # vLLM's head stays "ready": this is what gpufleet's watch is for
    assert chat(port) == 500
    head.wait(timeout=15)
    assert head.returncode == 1
    assert "EngineDeadError" in head.stdout.read()


def test_a_head_whose_rank_never_joins_gives_up_after_the_engine_ready_timeout(model, procs):
    port, master = free_port(), free_port()
    head = start(model, master, 0, "--port", str(port), env={"VLLM_ENGINE_READY_TIMEOUT_S": "1"})
    out, _ = head.communicate(timeout=15)
    assert head.returncode == 1
    assert "Timed out waiting for engine core processes to start (ranks [1] never joined)" in out


def test_a_rank_whose_head_never_comes_gives_up_after_the_join_timeout(model, procs):
    rank = start(model, free_port(), 1, env={"STANDIN_JOIN_TIMEOUT_S": "1"})
    out, _ = rank.communicate(timeout=15)
    assert rank.returncode == 1 and "DistStoreError: Timed out after 1 seconds" in out
