"""Every lint rule fires on the trap it names and stays quiet once the suggested fix is applied."""

from __future__ import annotations

import pytest

from gpufleet.lint import RULES, lint_spec
from gpufleet.settings import build_spec, merged_settings

# rule id -> (host data that triggers it, host data that applies the rule's fix)
CASES = {
    "privileged-exposes-all-gpus": ({}, {"vllm_docker_options": {"privileged": None}}),
    "mamba-block-size-ignored": ({}, {"vllm_args": {"mamba-block-size": None}}),
    "flashinfer-moe-fp16-deprecated": ({}, {"vllm_env": {"VLLM_USE_FLASHINFER_MOE_FP16": None}}),
    "pytorch-alloc-conf-alone": ({}, {"vllm_env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}),
    "open-without-api-key": ({}, {"vllm_api_key": "sk-test"}),
    "trust-remote-code-unneeded": ({}, {"vllm_args": {"trust-remote-code": None}}),
    "max-num-seqs-below-pipeline-depth": ({}, {"vllm_args": {"max-num-seqs": 3}}),
    "hybrid-prefix-caching-without-chunked-prefill": (
        {"vllm_args": {"enable-chunked-prefill": False}},
        {"vllm_args": {"enable-chunked-prefill": True}},
    ),
    "hybrid-align-chunk-alignment": ({}, {"vllm_args": {"prefix-match-unit": 128}}),
}


def rule_ids(data: dict) -> set[str]:
    return {f.rule.id for f in lint_spec(build_spec("box", data), merged_settings(data))}


def test_every_rule_has_a_case():
    assert {r.id for r in RULES} == set(CASES)


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_fires_and_its_fix_silences_it(rule_id):
    trigger, fix = CASES[rule_id]
    assert rule_id in rule_ids(trigger)
    assert rule_id not in rule_ids({**trigger, **fix})


def test_chunk_alignment_is_fine_when_batch_equals_a_pinned_block_size():
    assert "hybrid-align-chunk-alignment" not in rule_ids({"vllm_args": {"block-size": 1024, "max-num-batched-tokens": 1024}})
    assert "hybrid-align-chunk-alignment" in rule_ids({"vllm_args": {"block-size": 1024, "max-num-batched-tokens": 2048}})


def test_host_bound_to_loopback_needs_no_key():
    assert "open-without-api-key" not in rule_ids({"vllm_args": {"host": "127.0.0.1"}})


def test_findings_are_one_line_with_host_rule_and_fix():
    for finding in lint_spec(build_spec("gpu-box-1", {}), merged_settings({})):
        text = str(finding)
        assert text.startswith("gpu-box-1: warning [") and "(fix: " in text and "\n" not in text
