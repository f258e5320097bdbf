"""The stand-in vLLM's engine: served names, limits, a prefix cache hashed as vLLM's block chain, and /metrics."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:
    from .vllm_argv import fail, human_int
else:  # the image runs it as a script beside its modules
    from vllm_argv import fail, human_int

# vLLM's buckets for vllm:time_to_first_token_seconds
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)


class Engine:
    def __init__(self, args: argparse.Namespace, model: str, config: dict[str, Any]):
        self.args = args
        self.model = model
        self.names = args.served_model_name or [model]
        derived = int(config.get("max_position_embeddings", 2048))
        self.max_model_len = human_int(args.max_model_len) or derived
        if self.max_model_len > derived:
            fail(
                1,
                f"ValueError: User-specified max_model_len ({self.max_model_len}) is greater than the derived "
                f"max_model_len (max_position_embeddings={derived} in model's config.json).",
            )
        self.prefix_caching = args.enable_prefix_caching is not False
        self.block_size = int(args.block_size or 16)
        self.match_unit = int(args.prefix_match_unit) if getattr(args, "prefix_match_unit", None) else None
        self.api_keys = list(args.api_key or []) or (
            [os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY") else []
        )
        try:  # --default-chat-template-kwargs '{"enable_thinking": false}': what a request's own kwargs override
            self.template_kwargs = dict(json.loads(args.default_chat_template_kwargs or "{}"))
        except (ValueError, TypeError):
            fail(
                2,
                f"vllm serve: error: argument --default-chat-template-kwargs: invalid loads value: "
                f"'{args.default_chat_template_kwargs}'",
            )
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        self.dead = False
        self.group: Any = None  # a vllm_group.Head with --nnodes
        self.running = 0
        self.counters = {
            "prefix_cache_queries": 0,
            "prefix_cache_hits": 0,
            "prompt_tokens_cached": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "kv_sum": 0,
            "kv_count": 0,
        }
        self.ttft: list[float] = []
        # Per prompt character despite the name, so callers' rates keep their meaning.
        self.seconds_per_char = float(os.environ.get("STANDIN_PREFILL_SECONDS_PER_TOKEN", "0.000005"))
        self.seconds_per_token = float(os.environ.get("STANDIN_DECODE_SECONDS_PER_TOKEN", "0.005"))

    def cached_tokens(self, tokens: list[str]) -> int:
        """Longest previously seen block-aligned prefix, never the whole prompt: floor((L-1)/B)*B at most."""
        if not self.prefix_caching:
            return 0
        unit = self.match_unit or self.block_size
        running, hashes = hashlib.sha256(), []
        for k in range(unit, len(tokens), unit):  # a block's hash covers every token before it, as vLLM's chain
            # Per block, joined by a separator no token holds: per-token updates are slow on long prompts.
            running.update("\x1f".join(tokens[k - unit : k]).encode() + b"\x1e")
            hashes.append(running.hexdigest())
        with self.lock:
            hit = 0
            for k, h in zip(range(unit, len(tokens), unit), hashes, strict=False):
                if h not in self.seen:
                    break
                hit = k
            self.seen.update(hashes)
        return hit

    def account(self, prompt: int, cached: int, generated: int, ttft: float) -> None:
        with self.lock:
            c = self.counters
            c["prefix_cache_queries"] += prompt if self.prefix_caching else 0
            c["prefix_cache_hits"] += cached
            c["prompt_tokens_cached"] += cached
            c["prompt_tokens"] += prompt
            c["generation_tokens"] += generated
            c["kv_sum"] += prompt - cached
            c["kv_count"] += 1
            self.ttft.append(ttft)

    def cache_config(self) -> dict[str, Any]:
        a = self.args
        info = {
            "block_size": self.block_size,
            "cache_dtype": a.kv_cache_dtype or "auto",
            "enable_prefix_caching": self.prefix_caching,
            "gpu_memory_utilization": a.gpu_memory_utilization or 0.92,
            "is_attention_free": False,
            "kv_cache_memory_bytes": a.kv_cache_memory_bytes,
            "mamba_block_size": a.mamba_block_size,
            "mamba_cache_dtype": getattr(a, "mamba_cache_dtype", None) or "auto",
            "mamba_cache_mode": a.mamba_cache_mode or "none",
            "num_cpu_blocks": 0,
            "num_gpu_blocks": 8192,
            "prefix_caching_hash_algo": "sha256",
            "sliding_window": None,
        }
        if self.match_unit:
            info["prefix_match_unit"] = self.match_unit
        return {k: str(v) for k, v in sorted(info.items())}

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.names[0]}"'
        c = self.counters
        out: list[str] = []

        def metric(name: str, kind: str, value: float, help_text: str, extra: str = "") -> None:
            out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
            suffix = "_total" if kind == "counter" else ""
            out.append(f"{name}{suffix}{{{labels}{extra}}} {float(value)}\n")

        with self.lock:
            metric("vllm:num_requests_running", "gauge", self.running, "Number of requests in model execution batches.")
            metric("vllm:num_requests_waiting", "gauge", 0, "Number of requests waiting to be processed.")
            metric(
                "vllm:kv_cache_usage_perc",
                "gauge",
                min(1.0, len(self.seen) / 8192),
                "KV-cache usage. 1 means 100 percent usage.",
            )
            metric(
                "vllm:prefix_cache_queries",
                "counter",
                c["prefix_cache_queries"],
                "Prefix cache queries, in terms of number of queried tokens.",
            )
            metric(
                "vllm:prefix_cache_hits",
                "counter",
                c["prefix_cache_hits"],
                "Prefix cache hits, in terms of number of cached tokens.",
            )
            metric("vllm:prompt_tokens", "counter", c["prompt_tokens"], "Number of prefill tokens processed.")
            metric(
                "vllm:prompt_tokens_cached",
                "counter",
                c["prompt_tokens_cached"],
                "Number of cached prompt tokens (local + external).",
            )
            metric(
                "vllm:generation_tokens", "counter", c["generation_tokens"], "Number of generation tokens processed."
            )
            out.append(
                "# HELP vllm:request_prefill_kv_computed_tokens Histogram of new KV tokens computed during "
                "prefill (excluding cached tokens).\n# TYPE vllm:request_prefill_kv_computed_tokens histogram\n"
            )
            out.append(f"vllm:request_prefill_kv_computed_tokens_sum{{{labels}}} {float(c['kv_sum'])}\n")
            out.append(f"vllm:request_prefill_kv_computed_tokens_count{{{labels}}} {float(c['kv_count'])}\n")
            out.append(
                "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n"
                "# TYPE vllm:time_to_first_token_seconds histogram\n"
            )
            for b in TTFT_BUCKETS:
                n = sum(1 for t in self.ttft if t <= b)
                out.append(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{b}"}} {float(n)}\n')
            out.append(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="+Inf"}} {float(len(self.ttft))}\n')
            out.append(f"vllm:time_to_first_token_seconds_count{{{labels}}} {float(len(self.ttft))}\n")
            out.append(f"vllm:time_to_first_token_seconds_sum{{{labels}}} {sum(self.ttft)}\n")
        cache_labels = ",".join(f'{k}="{v}"' for k, v in self.cache_config().items())
        out.append(
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n"
        )
        out.append(f'vllm:cache_config_info{{{cache_labels},engine="0"}} 1.0\n')
        return "".join(out)
