"""Whether a host may take the canary's compiled artifacts: same GPUs, driver, serve config and compile hash."""

from __future__ import annotations

from dataclasses import dataclass

from pyinfra.api.exceptions import FactProcessError

from gpufleet.errors import one_line
from gpufleet.facts.nvidia import parse_gpus
from gpufleet.rollout.compile_factors import CompileFactors, differing
from gpufleet.vllm.spec import ServeSpec


@dataclass(frozen=True)
class Gpus:
    names: tuple[str, ...]  # one per GPU
    driver: str

    def describe(self) -> str:
        if not self.names:
            return "no GPU"
        kinds = sorted(set(self.names))
        return f"{len(self.names)}x {'/'.join(kinds)}, driver {self.driver}"


def gpus_from_query(rc: int, out: str, err: str) -> Gpus | str:
    """Parse QUERY_GPUS's answer, or say why not."""
    if rc != 0:
        return one_line(f"nvidia-smi failed: {(err or out).strip()[:160] or f'exit {rc}'}")
    try:
        gpus = parse_gpus(out.splitlines())
    except FactProcessError as e:
        return one_line(str(e))
    drivers = {gpu.driver_version for gpu in gpus}
    if len(drivers) > 1:
        return f"GPUs report different drivers: {', '.join(sorted(drivers))}"
    return Gpus(tuple(gpu.name for gpu in gpus), drivers.pop() if drivers else "")


def gpu_refusal(canary: str, canary_gpus: Gpus | str, host_gpus: Gpus | str) -> str | None:
    """Kernels are built for one GPU model and driver."""
    if isinstance(canary_gpus, str):
        return f"canary {canary}'s GPUs unknown ({canary_gpus})"
    if isinstance(host_gpus, str):
        return f"its GPUs unknown ({host_gpus})"
    if sorted(canary_gpus.names) != sorted(host_gpus.names) or canary_gpus.driver != host_gpus.driver:
        return f"its GPUs ({host_gpus.describe()}) differ from canary {canary}'s ({canary_gpus.describe()})"
    return None


# Flags that do not reach vLLM's compile: hosts may differ in them.
NOT_COMPILED = frozenset({"host", "port", "served-model-name", "api-key", "uvicorn-log-level"})


def config_refusal(canary: str, canary_spec: ServeSpec, host_spec: ServeSpec) -> str | None:
    """vLLM's cache key has missed a config field before, so only identical configs share artifacts."""

    def flags(spec: ServeSpec) -> dict[str, object]:
        return {k: v for k, v in spec.vllm_args if k not in NOT_COMPILED}

    a, b = flags(canary_spec), flags(host_spec)
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    env_a, env_b = dict(canary_spec.env), dict(host_spec.env)
    differ += sorted(f"env {k}" for k in env_a.keys() | env_b.keys() if env_a.get(k) != env_b.get(k))
    if len(canary_spec.gpus) != len(host_spec.gpus):
        differ.append("the number of GPUs it serves on")
    if not differ:
        return None
    shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    return f"its serve config differs from canary {canary}'s ({shown})"


def compile_hash_refusal(
    canary: str, canary_factors: CompileFactors | str, host_factors: CompileFactors | str
) -> str | None:
    """A host computing another hash would look up another dir and compile beside the carried one."""
    if isinstance(canary_factors, str):
        return f"canary {canary}'s compile hash unknown ({canary_factors})"
    if isinstance(host_factors, str):
        return f"its compile hash unknown ({host_factors})"
    if canary_factors.vllm != host_factors.vllm:
        return f"its vLLM {host_factors.vllm} is not canary {canary}'s {canary_factors.vllm}"
    if canary_factors.env_hash == host_factors.env_hash:
        return None
    names = differing(canary_factors, host_factors)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"its compile hash differs from canary {canary}'s (factors that differ: {shown or 'none named'})"
