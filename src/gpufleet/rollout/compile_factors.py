"""The env part of vLLM's compile-cache key, computed by the image's own vLLM on each host
(docs/compile-cache.md). Each value leaves the host as its sha256 only: the API key is one of them."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from gpufleet.errors import one_line
from gpufleet.vllm.spec import ServeSpec

TIMEOUT_S = 120  # importing vLLM and torch on a host that is serving
MARK = "gpufleet-compile-factors "
SCRIPT = (
    "import hashlib, json, vllm, vllm.envs as envs\n"
    "from vllm.config.utils import hash_factors\n"
    "f = envs.compile_factors()\n"
    "d = {k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16] for k, v in f.items()}\n"
    f"print({MARK!r} + json.dumps({{'vllm': vllm.__version__, 'env': hash_factors(f), 'factors': d}}))\n"
)


@dataclass(frozen=True)
class CompileFactors:
    vllm: str
    env_hash: str
    factor_sha256: tuple[tuple[str, str], ...]  # (name, sha256 prefix)


def factors_command(spec: ServeSpec, image: str, env_file: str) -> str:
    """Run `image`'s python3 with the env and secrets the host's container gets."""
    argv = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3"]
    for name, value in spec.env:
        argv += ["-e", f"{name}={value}"]
    secrets = shlex.quote(env_file)
    run = " ".join(shlex.quote(a) for a in argv)
    return (
        f"set --; [ -f {secrets} ] && set -- --env-file {secrets}; "
        f'timeout -k 5 {TIMEOUT_S} {run} "$@" {shlex.quote(image)} -c {shlex.quote(SCRIPT)} 2>&1'
    )


def parse_factors(rc: int, out: str) -> CompileFactors | str:
    """CompileFactors, or one line saying why they are not known."""
    line = next((ln for ln in out.splitlines() if ln.startswith(MARK)), None)
    if rc != 0 or line is None:
        last = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or [f"exit {rc}"]
        return one_line(f"the image's vLLM did not compute them (exit {rc}: {last[0][:160]})")
    try:
        doc = json.loads(line[len(MARK) :])
        factor_sha256 = tuple(sorted((str(k), str(v)) for k, v in doc["factors"].items()))
        return CompileFactors(str(doc["vllm"]), str(doc["env"]), factor_sha256)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return one_line(f"unreadable answer ({e}): {line[:160]}")


def differing(a: CompileFactors, b: CompileFactors) -> list[str]:
    """Names whose values differ, one-sided ones included."""
    da, db = dict(a.factor_sha256), dict(b.factor_sha256)
    return sorted(k for k in da.keys() | db.keys() if da.get(k) != db.get(k))
