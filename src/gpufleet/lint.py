"""The config doctor: known vLLM traps in a host's spec, each rule plain data (id, message, fix).

Add a rule by appending a LintRule to RULES; `applies` reads only the spec (and the host's settings for secrets
it must not print), so rules stay offline and testable. Facts behind the rules: docs/vllm-traps.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.spec import ServeSpec


@dataclass(frozen=True)
class LintContext:
    spec: ServeSpec
    settings: Mapping[str, Any]  # merged settings (secrets are only tested for presence)

    def arg(self, name: str):
        return self.spec.arg(name)

    def int_arg(self, name: str, default: int | None = None) -> int | None:
        value = self.spec.arg(name)
        return int(value) if isinstance(value, str) and value.isdigit() else default

    @property
    def env(self) -> dict[str, str]:
        return dict(self.spec.env)

    @property
    def options(self) -> dict:
        return dict(self.spec.docker_options)


@dataclass(frozen=True)
class LintRule:
    id: str
    message: str  # what is wrong and why it matters (format fields from the context allowed)
    fix: str  # the setting to change
    applies: Callable[[LintContext], bool]


@dataclass(frozen=True)
class Finding:
    host: str
    rule: LintRule

    def __str__(self) -> str:
        return f"{self.host}: warning [{self.rule.id}] {self.rule.message} (fix: {self.rule.fix})"


def _align_without_safe_chunking(c: LintContext) -> bool:
    if not (c.spec.hybrid and c.spec.prefix_caching and c.spec.mamba_cache_mode == "align"):
        return False
    if c.arg("prefix-match-unit"):
        return False
    block = c.int_arg("block-size")
    # The attention block size of a hybrid in align mode is chosen at start-up (~528-2048 tokens on GPUs):
    # unless it is pinned and the batch equals it, chunks can end off a block boundary.
    return block is None or c.int_arg("max-num-batched-tokens") != block


RULES: tuple[LintRule, ...] = (
    LintRule(
        "privileged-exposes-all-gpus",
        "--privileged makes every GPU visible in the container, whatever --gpus device=... lists",
        'drop it: vllm_docker_options = {"privileged": None}',
        lambda c: "privileged" in c.options,
    ),
    LintRule(
        "mamba-block-size-ignored",
        "--mamba-block-size is ignored when --mamba-cache-mode is align (vLLM sets it to the attention block size)",
        'remove it: vllm_args = {"mamba-block-size": None}',
        lambda c: c.arg("mamba-block-size") is not None and c.spec.mamba_cache_mode == "align",
    ),
    LintRule(
        "flashinfer-moe-fp16-deprecated",
        "VLLM_USE_FLASHINFER_MOE_FP16 is deprecated (removed in newer vLLM; logs 'Unknown vLLM environment variable')",
        'remove it: vllm_env = {"VLLM_USE_FLASHINFER_MOE_FP16": None}',
        lambda c: "VLLM_USE_FLASHINFER_MOE_FP16" in c.env,
    ),
    LintRule(
        "pytorch-alloc-conf-alone",
        "PYTORCH_ALLOC_CONF alone is ignored by some torch versions (2.9.1); vLLM reads PYTORCH_CUDA_ALLOC_CONF",
        "also set vllm_env PYTORCH_CUDA_ALLOC_CONF to the same value",
        lambda c: "PYTORCH_ALLOC_CONF" in c.env and "PYTORCH_CUDA_ALLOC_CONF" not in c.env,
    ),
    LintRule(
        "open-without-api-key",
        "--host 0.0.0.0 serves every network the host is on, and no API key is set",
        'set vllm_api_key (kept in a root-only file) or vllm_args = {"host": "127.0.0.1"}',
        lambda c: c.arg("host") in ("0.0.0.0", "::") and not c.settings.get("vllm_api_key"),
    ),
    LintRule(
        "trust-remote-code-unneeded",
        "--trust-remote-code runs the model repo's Python code, but this architecture is supported by vLLM itself",
        'remove it: vllm_args = {"trust-remote-code": None}',
        lambda c: c.arg("trust-remote-code") is True and c.spec.native_model,
    ),
    LintRule(
        "max-num-seqs-below-pipeline-depth",
        "max-num-seqs is below pipeline-parallel-size: some pipeline stages sit idle",
        "set vllm_args max-num-seqs to at least pipeline-parallel-size",
        lambda c: c.int_arg("max-num-seqs", 1024) < c.int_arg("pipeline-parallel-size", 1),
    ),
    LintRule(
        "hybrid-prefix-caching-without-chunked-prefill",
        "prefix caching on a hybrid model needs chunked prefill (align mode requires it)",
        'set vllm_args = {"enable-chunked-prefill": True}',
        lambda c: c.spec.hybrid and c.spec.prefix_caching and c.arg("enable-chunked-prefill") is not True,
    ),
    LintRule(
        "hybrid-align-chunk-alignment",
        "on a hybrid in align mode, prompt chunks that end off a block boundary silently lose whole prefix "
        "hits (measured: docs/vllm-traps.md)",
        'set vllm_args = {"prefix-match-unit": 128}, then check with `gpufleet verify INVENTORY --probe`',
        _align_without_safe_chunking,
    ),
)


def lint_spec(spec: ServeSpec, settings: Mapping[str, Any], rules: tuple[LintRule, ...] = RULES) -> list[Finding]:
    context = LintContext(spec, settings)
    return [Finding(spec.host, rule) for rule in rules if rule.applies(context)]
