"""The stand-in vLLM's compile cache, keyed by its version as vLLM's torch.compile cache (docs/test-hosts.md)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:
    from .vllm_argv import VERSION
    from .vllm_envs import compile_factors, hash_factors
else:  # the image runs it as a script beside its modules
    from vllm_argv import VERSION
    from vllm_envs import compile_factors, hash_factors

# Only the image (which sets VLLM_USAGE_SOURCE) compiles by default; unit tests set STANDIN_COMPILE_SECONDS.
IN_IMAGE = os.environ.get("VLLM_USAGE_SOURCE") == "production-docker-image"
ARTIFACT_BYTES = 64 * 1024


def compile_seconds() -> float:
    return float(os.environ.get("STANDIN_COMPILE_SECONDS") or (2.0 if IN_IMAGE else 0.0))


def cache_root() -> Path:
    return Path(os.environ.get("VLLM_CACHE_ROOT") or Path.home() / ".cache" / "vllm")


def compile_key(args: argparse.Namespace, config: dict[str, Any]) -> str:
    """What vLLM's cache dir hash covers, in small."""
    factors = {
        "version": VERSION,
        "env": hash_factors(compile_factors()),
        "config": config,
        "tp": args.tensor_parallel_size,
        "pp": args.pipeline_parallel_size,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()


def artifact(key: str) -> bytes:
    """Deterministic bytes for a key, so a damaged or foreign file is told apart."""
    out, block = bytearray(), hashlib.sha256(key.encode()).digest()
    while len(out) < ARTIFACT_BYTES:
        block = hashlib.sha256(block).digest()
        out += block
    return bytes(out[:ARTIFACT_BYTES])


def warm_or_compile(args: argparse.Namespace, config: dict[str, Any]) -> None:
    """Load the compiled artifact from the cache, or "compile" (sleep) and save it, logging as vLLM does."""
    seconds = compile_seconds()
    if seconds <= 0 or args.enforce_eager or args.optimization_level == 0:
        return
    key = compile_key(args, config)
    aot = cache_root() / "torch_compile_cache" / "torch_aot_compile"
    path = aot / key / "rank_0_0" / "model"
    tag = f"(Worker pid={os.getpid()}) "
    try:
        if path.read_bytes() == artifact(key):
            print(
                f"{tag}INFO [decorators.py:320] [backbone] Directly load AOT compilation from path {path}", flush=True
            )
            return
        reason = "Compile cache file corrupted."
    except FileNotFoundError:
        reason = ""
    except OSError as e:
        reason = str(e)
    if reason:
        print(
            f"{tag}WARNING [decorators.py:333] [backbone] Compiling model again due to a load failure from {path}, "
            f"reason: {reason}",
            flush=True,
        )
    started = time.monotonic()
    time.sleep(seconds)
    try:
        tmp = aot / f".tmp-{key[:16]}-{os.getpid()}"
        (tmp / "rank_0_0").mkdir(parents=True, exist_ok=True)
        (tmp / "rank_0_0" / "model").write_bytes(artifact(key))
        (tmp / "inductor_cache" / key[:2]).mkdir(parents=True, exist_ok=True)
        (tmp / "inductor_cache" / key[:2] / f"c{key[:40]}.so").write_bytes(artifact(key[::-1])[:16384])
        if (aot / key).exists():  # vLLM saves over an entry that did not load
            (aot / key / "rank_0_0").mkdir(parents=True, exist_ok=True)
            os.replace(tmp / "rank_0_0" / "model", path)
            for leftover in sorted(tmp.rglob("*"), reverse=True):
                leftover.unlink() if leftover.is_file() else leftover.rmdir()
            tmp.rmdir()
        else:
            os.rename(tmp, aot / key)
    except OSError as e:  # vLLM goes on without saving
        print(f"{tag}WARNING cannot save the compiled function to {path}: {e}", flush=True)
        return
    print(f"{tag}INFO [decorators.py:743] [backbone] saved AOT compiled function to {path}", flush=True)
    print(f"{tag}INFO [backends.py] torch.compile took {time.monotonic() - started:.2f} s in total", flush=True)
