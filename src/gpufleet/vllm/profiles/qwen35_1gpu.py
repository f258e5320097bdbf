"""`qwen35-1gpu`: Qwen 3.5 35B-A3B on one 80-141 GB GPU, no pipeline parallelism.

The qwen35 profile's prefix-caching settings for the hybrid model (align mode, chunked prefill, interactivity,
fp8 KV cache), on one card and Qwen's official FP8 checkpoint. Its service name and cache dir differ from
qwen35's, so both can run on one host (give one of them another vllm_port and vllm_gpus). What differs from
qwen35 and why: docs/profiles.md.
"""

from __future__ import annotations

from dataclasses import replace

from gpufleet.vllm.profiles import qwen35
from gpufleet.vllm.profiles._profile import JIT_REDIRECTS

# Flags of qwen35 this profile does without: one GPU needs no pipeline; the architecture is vLLM's own (no remote
# code to run); align mode ignores --mamba-block-size (gpufleet lint warns about each on qwen35).
_DROPPED_FLAGS = ("pipeline-parallel-size", "trust-remote-code", "mamba-block-size")

PROFILE = replace(
    qwen35.PROFILE,
    name="qwen35-1gpu",
    model="qwen3.5-35b-a3b-fp8",
    # Qwen's own FP8 checkpoint (~35 GiB of weights): on one 80 GB card that leaves ~30 GiB for the KV cache at
    # vLLM's default gpu-memory-utilization 0.92; the 4-bit AWQ of qwen35 would save memory at some quality cost.
    model_repo="Qwen/Qwen3.5-35B-A3B-FP8",
    model_revision=None,
    service="vllm-qwen35-1gpu",
    cache_subdir="qwen35-1gpu",
    gpus=(0,),
    env={
        **{k: v for k, v in qwen35.PROFILE.env.items() if k != "VLLM_USE_FLASHINFER_MOE_FP16"},  # deprecated
        # torch 2.9.1 ignores PYTORCH_ALLOC_CONF and vLLM reads PYTORCH_CUDA_ALLOC_CONF: set both.
        "PYTORCH_CUDA_ALLOC_CONF": qwen35.PROFILE.env["PYTORCH_ALLOC_CONF"],
        # Triton's and FlashInfer's JIT caches into the vLLM cache mount: restarts keep them, the rollout carries them.
        **JIT_REDIRECTS,
    },
    vllm_args={
        **{k: v for k, v in qwen35.PROFILE.vllm_args.items() if k not in _DROPPED_FLAGS},
        # The model's native context. Only the 10 full-attention layers of 40 keep per-token KV (2 KV heads x 256
        # dims, fp8): 10 KiB a token, 2.5 GiB for a full 262k conversation; the GDN layers keep a fixed state.
        "max-model-len": 262144,
        # 4 full-length conversations take 10 GiB of the ~30 GiB cache an 80 GB card has: the rest keeps the
        # prefixes of conversations between turns (a coding agent's tool call), which is what makes a returning
        # turn fast. More running sequences would evict them; a 141 GB card simply keeps more prefixes.
        "max-num-seqs": 4,
        # Finish the answers being streamed on a restart instead of cutting them off (the unit's stop timeouts
        # follow and stay above it).
        "shutdown-timeout": 60,
    },
)
