"""`qwen35`: the published invocation, flag for flag (docs/profiles.md); `gpufleet lint` warns of its traps.

Golden tests fix its rendering: a change here restarts every host that runs it.
"""

from __future__ import annotations

from gpufleet.vllm.profiles._profile import Profile

# The published text exactly: re-serialising it would change every host's unit.
GENERATION_CONFIG = (
    '{ "temperature": 0.60, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 0.0, '
    '"repetition_penalty": 1.0, "max_tokens": 16384 }'
)

PROFILE = Profile(
    name="qwen35",
    model="qwen3.5-awq",
    model_repo="cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit",
    model_revision=None,
    service="vllm-qwen35",
    cache_subdir="qwen35",
    gpus=(0, 1, 2),
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
        "override-generation-config": GENERATION_CONFIG,
    },
    hybrid=True,
    native=True,
)
