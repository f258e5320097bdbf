"""The stand-in's `vllm.envs`: vLLM's compile_factors over the container's environment, for the rollout's
compile-hash check and the stand-in's compile cache.

It hashes the VLLM_* variables that are set, less vLLM's ignore list, so two containers get the same hash exactly
when vLLM 0.32 would give them one for the variables a deploy sets."""

from __future__ import annotations

import hashlib
import json
import os

# vLLM 0.32's compile_factors ignore list.
IGNORED = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "FORCE_COLOR",
        "LD_LIBRARY_PATH",
        "LOCAL_RANK",
        "MAX_JOBS",
        "NO_COLOR",
        "S3_ACCESS_KEY_ID",
        "S3_ENDPOINT_URL",
        "S3_SECRET_ACCESS_KEY",
        "VLLM_API_KEY",
        "VLLM_ASSETS_CACHE",
        "VLLM_ASSETS_CACHE_MODEL_CLEAN",
        "VLLM_AUDIO_FETCH_TIMEOUT",
        "VLLM_CACHE_ROOT",
        "VLLM_CONFIG_ROOT",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CUDA_COMPATIBILITY_PATH",
        "VLLM_DEBUG_DUMP_PATH",
        "VLLM_DEBUG_LOG_API_SERVER_RESPONSE",
        "VLLM_DO_NOT_TRACK",
        "VLLM_DP_MASTER_IP",
        "VLLM_DP_MASTER_PORT",
        "VLLM_ELASTIC_EP_SCALE_UP_LAUNCH",
        "VLLM_ENABLE_CUDA_COMPATIBILITY",
        "VLLM_ENABLE_STARTUP_PLAN",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS",
        "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR",
        "VLLM_FLASHINFER_AUTOTUNE_SKIP_OPS",
        "VLLM_FORCE_AOT_LOAD",
        "VLLM_HOST_IP",
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
        "VLLM_IMAGE_FETCH_TIMEOUT",
        "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH",
        "VLLM_LOGGING_COLOR",
        "VLLM_LOGGING_CONFIG_PATH",
        "VLLM_LOGGING_LEVEL",
        "VLLM_LOGGING_PREFIX",
        "VLLM_LOGGING_STREAM",
        "VLLM_LOG_STATS_INTERVAL",
        "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB",
        "VLLM_MAX_AUDIO_DECODE_BYTES",
        "VLLM_MAX_AUDIO_DECODE_DURATION_S",
        "VLLM_MAX_AUDIO_PREPROCESS_WORKERS",
        "VLLM_MAX_EMBED_DECODE_BYTES",
        "VLLM_MAX_IMAGE_PIXELS",
        "VLLM_MEDIA_CACHE",
        "VLLM_MEDIA_CACHE_MAX_SIZE_MB",
        "VLLM_MEDIA_CACHE_TTL_HOURS",
        "VLLM_MEDIA_CONNECTOR",
        "VLLM_MEDIA_FETCH_MAX_RETRIES",
        "VLLM_MEDIA_LOADING_THREAD_COUNT",
        "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
        "VLLM_MODEL_REDIRECT_PATH",
        "VLLM_NIXL_SIDE_CHANNEL_HOST",
        "VLLM_NO_USAGE_STATS",
        "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME",
        "VLLM_PORT",
        "VLLM_RANDOMIZE_DP_DUMMY_INPUTS",
        "VLLM_RINGBUFFER_WARNING_INTERVAL",
        "VLLM_RPC_BASE_PATH",
        "VLLM_SERVER_DEV_MODE",
        "VLLM_SKIP_MODEL_NAME_VALIDATION",
        "VLLM_SKIP_VERSION_SUFFIX",
        "VLLM_TEST_FORCE_LOAD_FORMAT",
        "VLLM_TRITON_JIT_WARMUP_NUM_THREADS",
        "VLLM_TUNED_CONFIG_FOLDER",
        "VLLM_USAGE_STATS_SERVER",
        "VLLM_USE_MODELSCOPE",
        "VLLM_V1_OUTPUT_PROC_CHUNK_SIZE",
        "VLLM_VIDEO_FETCH_TIMEOUT",
        "VLLM_VIDEO_LOADER_BACKEND",
        "VLLM_WORKER_MULTIPROC_METHOD",
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS",
        "VLLM_XLA_CACHE_PATH",
        "VLLM_ZENTORCH_WEIGHT_PREPACK",
    }
)


def compile_factors() -> dict[str, object]:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_") and k not in IGNORED}


def hash_factors(items: dict[str, object]) -> str:
    """vllm.config.utils.hash_factors."""
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()
