"""`qwen35-1gpu`: Qwen 3.5 35B-A3B FP8 on one 80-141 GB GPU. What differs from qwen35 and why: docs/profiles.md."""

from __future__ import annotations

from dataclasses import replace

from gpufleet.vllm.profiles import qwen35
from gpufleet.vllm.profiles._profile import JIT_REDIRECTS

_DROPPED_FLAGS = ("pipeline-parallel-size", "trust-remote-code", "mamba-block-size")

PROFILE = replace(
    qwen35.PROFILE,
    name="qwen35-1gpu",
    model="qwen3.5-35b-a3b-fp8",
    model_repo="Qwen/Qwen3.5-35B-A3B-FP8",
    model_revision=None,
    service="vllm-qwen35-1gpu",
    cache_subdir="qwen35-1gpu",
    gpus=(0,),
    env={
        **{k: v for k, v in qwen35.PROFILE.env.items() if k != "VLLM_USE_FLASHINFER_MOE_FP16"},  # deprecated
        # Some torch versions read only this name.
        "PYTORCH_CUDA_ALLOC_CONF": qwen35.PROFILE.env["PYTORCH_ALLOC_CONF"],
        **JIT_REDIRECTS,
    },
    vllm_args={
        **{k: v for k, v in qwen35.PROFILE.vllm_args.items() if k not in _DROPPED_FLAGS},
        "max-model-len": 262144,
        # More would evict the prefixes kept between turns.
        "max-num-seqs": 4,
        "shutdown-timeout": 60,
    },
)
