"""Profiles: a known-good service definition that host data refines.

`qwen35` is the write-up's invocation (../docs/seed-invocation.md), flag for flag and value for value. Where that
invocation has known problems, `gpufleet lint` warns and offers the fix; the profile does not silently change
what users asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Profile:
    name: str
    # docker run options in order; value True = bare flag, str = "--name=value", list = repeated "--name v".
    # "runtime" always renders first and --gpus right after it, as in the write-up.
    docker_options: dict[str, Any]
    env: dict[str, str]
    # container paths of the mounts; host paths come from the settings (see settings.py).
    models_mount: str
    cache_mounts: dict[str, str]  # subdirectory of vllm_cache_dir -> container path
    # vLLM flags in order. "{model_path}", "{served_model_name}" and "{port}" are filled from the settings.
    vllm_args: dict[str, Any]
    hybrid: bool  # linear-attention (Mamba/GDN) + attention layers: prefix caching needs align mode
    native: bool  # architecture supported by vLLM itself: --trust-remote-code is unnecessary
    notes: tuple[str, ...] = field(default_factory=tuple)


QWEN35 = Profile(
    name="qwen35",
    docker_options={
        "runtime": "nvidia",
        "privileged": True,
        "ipc": "host",
        "ulimit": ["memlock=-1", "stack=67108864"],
    },
    env={
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "LD_LIBRARY_PATH": "/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu",
        "PYTORCH_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512",
        "VLLM_SLEEP_WHEN_IDLE": "1",
        "OMP_NUM_THREADS": "16",
        "VLLM_USE_DEEP_GEMM": "0",
        "VLLM_USE_FLASHINFER_MOE_FP16": "1",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    },
    models_mount="/models",
    cache_mounts={
        "vllm": "/root/.cache/vllm",
        "torch": "/root/.cache/torch",
        "ComputeCache": "/root/.nv/ComputeCache",
    },
    vllm_args={
        "model": "{model_path}",
        "served-model-name": "{served_model_name}",
        "host": "0.0.0.0",
        "port": "{port}",
        "max-model-len": 225000,
        "max-num-batched-tokens": 8192,
        "pipeline-parallel-size": 3,
        "kv-cache-dtype": "fp8_e4m3",
        "max-num-seqs": 2,
        "tool-call-parser": "qwen3_coder",
        "reasoning-parser": "qwen3",
        "enable-auto-tool-choice": True,
        "optimization-level": 3,
        "enable-prefix-caching": True,
        "trust-remote-code": True,
        "language-model-only": True,
        "performance-mode": "interactivity",
        "mamba-cache-mode": "align",
        "mamba-block-size": 8,
        "enable-chunked-prefill": True,
        "async-scheduling": True,
        # Kept as the write-up's exact text (spacing and 0.60 included), not re-serialised.
        "override-generation-config": '{ "temperature": 0.60, "top_p": 0.95, "top_k": 20, "min_p": 0.0, '
        '"presence_penalty": 0.0, "repetition_penalty": 1.0, "max_tokens": 16384 }',
    },
    hybrid=True,
    native=True,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (QWEN35,)}
