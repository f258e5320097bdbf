"""The stand-in `vllm serve`'s compile cache: a start without its version's entry compiles (slower) and writes it, a
start that finds it loads it and says so, as vLLM 0.32 logs it; another version starts cold beside it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufleet import sandbox
from gpufleet.sandbox.image import write_tiny_model
from tests.ports import free_port

SERVE = Path(sandbox.__file__).parent / "standin" / "vllm_serve.py"
COMPILE_S = 1.5
LOADED = "Directly load AOT compilation from path"
SAVED = "saved AOT compiled function to"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models") / "tiny"
    write_tiny_model(d)
    return d


def start(
    model: Path,
    cache: Path,
    log: Path,
    version: str = "0.32.1.dev30+gstandin",
    compile_s: float | None = COMPILE_S,
    *args: str,
) -> tuple[float, str]:
    """Start the stand-in, wait until it listens, stop it: (seconds to listen, its output)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USAGE_SOURCE"}
    env |= {"STANDIN_LOAD_SECONDS": "0", "VLLM_CACHE_ROOT": str(cache), "STANDIN_VLLM_VERSION": version}
    if compile_s is not None:
        env["STANDIN_COMPILE_SECONDS"] = str(compile_s)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(SERVE), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    t0 = time.monotonic()
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() - t0 < 20, "never listened"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        return time.monotonic() - t0, log.read_text()
    finally:
        proc.terminate()
        proc.wait(10)


def entries(cache: Path) -> list[str]:
    aot = cache / "torch_compile_cache" / "torch_aot_compile"
    return sorted(p.name for p in aot.iterdir()) if aot.is_dir() else []


def test_cold_start_compiles_and_writes_its_entry_a_copied_cache_starts_warm(model, tmp_path):
    cold_s, cold_log = start(model, tmp_path / "a", tmp_path / "cold.log")
    assert SAVED in cold_log and LOADED not in cold_log, cold_log
    assert cold_s >= COMPILE_S
    (key,) = entries(tmp_path / "a")
    assert (tmp_path / "a" / "torch_compile_cache" / "torch_aot_compile" / key / "rank_0_0" / "model").is_file()
    assert not list((tmp_path / "a").rglob(".tmp-*"))  # written beside, renamed into place

    shutil.copytree(tmp_path / "a", tmp_path / "b")  # what a carry does: the same entry in another cache dir
    warm_s, warm_log = start(model, tmp_path / "b", tmp_path / "warm.log")
    assert LOADED in warm_log and SAVED not in warm_log, warm_log
    assert warm_s < cold_s
    assert entries(tmp_path / "b") == [key]


def test_another_version_starts_cold_beside_the_entry_of_the_first(model, tmp_path):
    start(model, tmp_path / "c", tmp_path / "1.log", version="0.32.1.dev20+gstandin")
    _, log = start(model, tmp_path / "c", tmp_path / "2.log", version="0.32.1.dev30+gstandin")
    assert SAVED in log and LOADED not in log
    assert len(entries(tmp_path / "c")) == 2
    # the parallel layout is part of the key too
    _, log = start(model, tmp_path / "c", tmp_path / "3.log", "0.32.1.dev30+gstandin", COMPILE_S, "-pp", "2")
    assert SAVED in log and len(entries(tmp_path / "c")) == 3


def test_a_damaged_entry_is_compiled_again_with_vllms_warning(model, tmp_path):
    start(model, tmp_path / "d", tmp_path / "1.log")
    (key,) = entries(tmp_path / "d")
    artifact = tmp_path / "d" / "torch_compile_cache" / "torch_aot_compile" / key / "rank_0_0" / "model"
    artifact.write_bytes(b"\0" * 100)
    seconds, log = start(model, tmp_path / "d", tmp_path / "2.log")
    assert "Compiling model again due to a load failure" in log and "corrupted" in log and SAVED in log
    assert seconds >= COMPILE_S
    _, log = start(model, tmp_path / "d", tmp_path / "3.log")
    assert LOADED in log


def test_outside_the_image_nothing_is_compiled_or_written_unless_asked(model, tmp_path):
    _, log = start(model, tmp_path / "e", tmp_path / "1.log", compile_s=None)
    assert SAVED not in log and LOADED not in log
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("flags", [("-O0",), ("--enforce-eager",)])
def test_no_compile_without_torch_compile(model, tmp_path, flags):
    seconds, log = start(model, tmp_path / "f", tmp_path / "1.log", "0.32.1.dev30+gstandin", COMPILE_S, *flags)
    assert SAVED not in log and LOADED not in log and seconds < COMPILE_S
    assert not (tmp_path / "f").exists()
