"""The stand-in `vllm serve` as the image installs it: its modules side by side, run through a `vllm` symlink."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gpufleet.rollout.compile_factors import SCRIPT, CompileFactors, differing, parse_factors
from gpufleet.sandbox import image
from tests.ports import free_port


def _own_imports(script: Path) -> set[str]:
    """The stand-in modules a file imports (from the package, `.vllm_argv`, or side by side, `vllm_argv`)."""
    names = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(script.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    return {f"{n}.py" for n in names if n and (image.STANDIN / f"{n}.py").is_file()}


def test_the_image_holds_every_module_the_stand_in_imports():
    for name in image.VLLM_MODULES:
        assert _own_imports(image.STANDIN / name) <= set(image.SOURCES), name
    assert _own_imports(image.STANDIN / "vllm_serve.py") == {
        "vllm_argv.py",
        "vllm_compile_cache.py",
        "vllm_engine.py",
        "vllm_group.py",
        "vllm_http.py",
    }


def test_installed_side_by_side_it_serves_through_the_vllm_symlink(tmp_path):
    opt, bin_dir = tmp_path / "opt", tmp_path / "bin"
    opt.mkdir()
    bin_dir.mkdir()
    image.install_sources(opt)
    (bin_dir / "vllm").symlink_to(opt / "vllm_serve.py")  # as /usr/bin/vllm -> /opt/gpufleet-standin/vllm_serve.py
    model = tmp_path / "model"
    image.write_tiny_model(model)
    env = {"PATH": os.environ["PATH"], "STANDIN_LOAD_SECONDS": "0", "STANDIN_VLLM_VERSION": "0.32.1.dev20+gstandin"}
    vllm = [sys.executable, str(bin_dir / "vllm"), "serve", str(model)]
    bad = subprocess.run([*vllm, "--no-such-flag"], capture_output=True, text=True, env=env, timeout=10, cwd=tmp_path)
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-flag" in bad.stderr  # the table next to it
    port = free_port()
    proc = subprocess.Popen(
        [*vllm, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/version", timeout=1) as r:
                    assert json.load(r) == {"version": "0.32.1.dev20+gstandin"}
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.05)
    finally:
        proc.terminate()
        assert proc.wait(5) == 0


def test_the_rollouts_compile_hash_script_runs_on_the_stand_ins_vllm_package(tmp_path):
    """What `docker run --entrypoint python3 <image> -c SCRIPT` runs in the image (its PYTHONPATH is the stand-ins' dir):
    the env hash follows what vLLM 0.32 hashes (VLLM_USE_DEEP_GEMM) and not what it ignores (VLLM_API_KEY)."""
    image.install_sources(tmp_path)

    def factors(**env: str) -> CompileFactors:
        run = subprocess.run(
            [sys.executable, "-c", SCRIPT],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=tmp_path,
            env={
                "PATH": os.environ["PATH"],
                "PYTHONPATH": str(tmp_path),
                "STANDIN_VLLM_VERSION": "0.32.1.dev30+gstandin",
                **env,
            },
        )
        parsed = parse_factors(run.returncode, run.stdout + run.stderr)
        assert isinstance(parsed, CompileFactors), parsed
        return parsed

    base = factors(VLLM_USE_DEEP_GEMM="0", VLLM_API_KEY="one")
    assert base.vllm == "0.32.1.dev30+gstandin" and dict(base.factor_sha256).keys() == {"VLLM_USE_DEEP_GEMM"}
    assert factors(VLLM_USE_DEEP_GEMM="0", VLLM_API_KEY="two") == base
    other = factors(VLLM_USE_DEEP_GEMM="1", VLLM_API_KEY="one")
    assert other.env_hash != base.env_hash and differing(base, other) == ["VLLM_USE_DEEP_GEMM"]
