"""Every validation rule: bad host data gives one-line errors naming host, setting and fix, and no spec."""

from __future__ import annotations

import pytest

from gpufleet.errors import SettingErrors
from gpufleet.vllm.settings import RUN_FLAGS, build_spec, renamed_settings, resolve_host

CASES = [
    # (host data, setting named in the error, words the problem or fix must contain)
    ({"gpufleet_image_ref": "vllm/vllm-openai:nightly"}, "gpufleet_image_ref", "not a digest reference"),
    ({"gpufleet_image_ref": "vllm/vllm-openai@sha256:abc"}, "gpufleet_image_ref", "64 hex digits"),
    ({"gpufleet_image_ref": "other/image@sha256:" + "a" * 64}, "gpufleet_image_ref", "repository vllm/vllm-openai"),
    ({"gpufleet_stage": "swap"}, "gpufleet_stage", "converge, prepare"),
    ({"gpufleet_model_sha": "main", "vllm_model_repo": "org/m"}, "gpufleet_model_sha", "not a commit"),
    # The old name of gpufleet_model_sha: named as written, and not both.
    ({"gpufleet_model_ref": "main", "vllm_model_repo": "org/m"}, "gpufleet_model_ref", "not a commit"),
    ({"gpufleet_model_ref": "a\nb"}, "gpufleet_model_ref", "control character (U+000A)"),
    ({"gpufleet_model_ref": "c" * 40, "gpufleet_model_sha": "c" * 40}, "gpufleet_model_ref", "drop gpufleet_model_ref"),
    ({"gpufleet_retry_failed": "yes"}, "gpufleet_retry_failed", "--data gpufleet_retry_failed=true"),
    ({"gpufleet_verify_probe": 1}, "gpufleet_verify_probe", "True or False"),
    ({"gpufleet_refresh_keys": "yes"}, "gpufleet_refresh_keys", "true/false"),
    ({"gpufleet_expect_committed": "gpu1=repo@sha256:0"}, "gpufleet_expect_committed", "map of host name"),
    ({"gpufleet_expect_committed": {"gpu1": 3}}, "gpufleet_expect_committed", "gpufleet_expect_committed={"),
    ({"vllm_profile": "llama"}, "vllm_profile", "qwen35"),
    ({"vllm_image": "Not An Image"}, "vllm_image", "repo:tag"),
    ({"vllm_gpus": []}, "vllm_gpus", "non-empty"),
    ({"vllm_gpus": "0,1,2"}, "vllm_gpus", "non-empty list"),
    ({"vllm_gpus": [0, 1, 1]}, "vllm_gpus", "twice"),
    ({"vllm_gpus": [0, -1, 2]}, "vllm_gpus", "non-negative"),
    ({"vllm_gpus": [0, 1, True]}, "vllm_gpus", "non-negative integers"),
    ({"vllm_port": 70000}, "vllm_port", "1 to 65535"),
    ({"vllm_port": "5000"}, "vllm_port", "not a port"),
    ({"vllm_models_dir": "~/models"}, "vllm_models_dir", "absolute"),
    ({"vllm_cache_dir": "relative/cache"}, "vllm_cache_dir", "absolute"),
    # The example fix is the host's profile's own cache dir.
    ({"vllm_profile": "qwen35-1gpu", "vllm_cache_dir": "/var/cache"}, "vllm_cache_dir", "/var/cache/vllm/qwen35-1gpu"),
    ({"vllm_profile": "qwen35-1gpu", "vllm_args": {"pipeline-parallel-size": 3}}, "vllm_gpus", "list 3 GPUs"),
    ({"vllm_model": "../escape"}, "vllm_model", "directory name"),
    ({"vllm_service": "bad name!"}, "vllm_service", "unit/label"),
    ({"vllm_args": {"kv-cache-dtype": "fp7"}}, "vllm_args['kv-cache-dtype']", "fp8_e4m3"),
    ({"vllm_args": {"mamba_cache_mode": "all"}}, "vllm_args['mamba_cache_mode']", "align, none"),
    ({"vllm_args": {"performance-mode": "fast"}}, "vllm_args['performance-mode']", "interactivity"),
    ({"vllm_args": {"optimization-level": 4}}, "vllm_args['optimization-level']", "0-3"),
    ({"vllm_args": {"optimization-level": "high"}}, "vllm_args['optimization-level']", "integer"),
    ({"vllm_args": {"max-num-seqs": "two"}}, "vllm_args['max-num-seqs']", "integer"),
    ({"vllm_args": {"max-model-len": "lots"}}, "vllm_args['max-model-len']", "token count"),
    ({"vllm_args": {"enable-prefix-caching": "yes"}}, "vllm_args['enable-prefix-caching']", "switch"),
    (
        {"vllm_args": {"language-model-only": None, "served-model-name": True}},
        "vllm_args['served-model-name']",
        "needs a value",
    ),
    ({"vllm_args": {"max-num-batched-tokens": 0}}, "vllm_args['max-num-batched-tokens']", ">= 1"),
    (
        {"vllm_args": {"max-num-batched-tokens": 1, "max-num-seqs": 2}},
        "vllm_args['max-num-batched-tokens']",
        "below max-num-seqs",
    ),
    ({"vllm_args": {"pipeline-parallel-size": 2}}, "vllm_gpus", "pipeline-parallel-size"),
    ({"vllm_gpus": [0, 1]}, "vllm_gpus", "set vllm_args pipeline-parallel-size to 2"),
    ({"vllm_args": {"tool-call-parser": None}}, "vllm_args['enable-auto-tool-choice']", "tool-call-parser"),
    (
        {"vllm_args": {"override-generation-config": "{temperature: 1}"}},
        "vllm_args['override-generation-config']",
        "JSON",
    ),
    ({"vllm_args": {"override-generation-config": "[1, 2]"}}, "vllm_args['override-generation-config']", "JSON object"),
    ({"vllm_args": {"max-modle-len": 1024}}, "vllm_args['max-modle-len']", "max-model-len"),
    ({"vllm_args": {"port": 6000}}, "vllm_args['port']", "vllm_port"),
    ({"vllm_args": {"api-key": "sk-x"}}, "vllm_args['api-key']", "vllm_api_key"),
    ({"vllm_args": ["--foo"]}, "vllm_args", "mapping"),
    ({"vllm_env": {"HF_TOKEN": "hf_x"}}, "vllm_env['HF_TOKEN']", "vllm_hf_token"),
    ({"vllm_env": {"BAD-NAME": "1"}}, "vllm_env['BAD-NAME']", "variable name"),
    ({"vllm_env": {"MULTI": "a\nb"}}, "vllm_env['MULTI']", "control character (U+000A)"),
    ({"vllm_docker_options": {"gpus": "all"}}, "vllm_docker_options['gpus']", "vllm_gpus"),
    ({"vllm_docker_options": {"shm-size": 16}}, "vllm_docker_options['shm-size']", "string"),
    ({"vllm_prot": 5000}, "vllm_prot", "vllm_port"),
    ({"vllm_api_key": 12345}, "vllm_api_key", "string"),
    ({"vllm_ready_timeout": -5}, "vllm_ready_timeout", "non-negative"),
    ({"gpufleet_min_cuda": "13"}, "gpufleet_min_cuda", "MAJOR.MINOR"),
    ({"gpufleet_allow_no_gpu": "yes"}, "gpufleet_allow_no_gpu", "True or False"),
    ({"docker_install": "snap"}, "docker_install", "distro"),
    ({"nvidia_repo_url": "ftp://x"}, "nvidia_repo_url", "http"),
    ({"gpufleet_gpu_verdicts": {"xid thirteen": "ok"}}, "gpufleet_gpu_verdicts", "'xid thirteen' is not a signal"),
    ({"gpufleet_gpu_verdicts": {"xid 13": "fine"}}, "gpufleet_gpu_verdicts", "restart-app, reset-gpu, reboot"),
    ({"gpufleet_gpu_verdicts": ["xid 13"]}, "gpufleet_gpu_verdicts", "not a map of signal to verdict"),
    ({"gpufleet_gpu_cleared_at": "2026-12-03T10:00:00"}, "gpufleet_gpu_cleared_at", "with its zone"),
    ({"gpufleet_gpu_cleared_at": 1764756000}, "gpufleet_gpu_cleared_at", "1764756000 is not an ISO 8601 time"),
]


@pytest.mark.parametrize(("data", "setting", "hint"), CASES, ids=[c[1] + ":" + c[2] for c in CASES])
def test_each_rule_names_host_setting_and_fix(data, setting, hint):
    with pytest.raises(SettingErrors) as raised:
        build_spec("box7", data)
    messages = [str(e) for e in raised.value.errors]
    matching = [m for m in messages if m.startswith(f"box7: {setting}: ")]
    assert matching, messages
    assert any(hint in m for m in matching), matching
    assert all("\n" not in m and "(fix: " in m for m in messages)


def test_all_problems_are_reported_at_once():
    with pytest.raises(SettingErrors) as raised:
        build_spec("box", {"vllm_port": 0, "vllm_gpus": [], "vllm_args": {"kv-cache-dtype": "fp7"}})
    assert {e.setting for e in raised.value.errors} == {"vllm_port", "vllm_gpus", "vllm_args['kv-cache-dtype']"}


def test_secret_values_never_appear_in_errors():
    with pytest.raises(SettingErrors) as raised:
        build_spec("box", {"vllm_api_key": "sk-line1\nline2"})
    assert "sk-line1" not in str(raised.value)


def test_valid_variations_are_accepted():
    spec = build_spec(
        "box",
        {
            "vllm_gpus": [4, 5, 6, 7],
            "vllm_args": {
                "pipeline_parallel_size": 2,
                "tensor-parallel-size": 2,
                "--max-model-len": "128k",
                "override-generation-config": {"temperature": 0.7},
            },
            "ssh_hostname": "10.0.0.1",
            "other_tool_setting": 1,  # not ours: ignored
            "gpufleet_gpu_verdicts": {"xid 43": "ok", "xid 200": "reboot"},
            "gpufleet_gpu_cleared_at": "2026-12-03T10:00:00Z",
        },
    )
    assert spec.arg("pipeline-parallel-size") == "2" and spec.arg("max-model-len") == "128k"
    assert spec.arg("override-generation-config") == '{"temperature": 0.7}'


@pytest.mark.parametrize(("word", "value"), [("true", True), ("False", False), (True, True)])
def test_run_flags_from_the_command_line_accept_the_words_true_and_false(word, value):
    settings = resolve_host("gpu1", dict.fromkeys(RUN_FLAGS, word))[1]
    assert (settings.retry_failed, settings.verify_probe, settings.refresh_keys, settings.speed_batches) == (value,) * 4
    assert "gpufleet_refresh_keys" in RUN_FLAGS


def test_the_old_name_of_a_renamed_setting_is_read_as_the_new_one_with_a_warning():
    sha = "c" * 40
    old = {"vllm_model_repo": "org/m", "gpufleet_model_ref": sha}
    assert resolve_host("gpu1", old)[1].model_sha == sha
    assert renamed_settings("gpu1", old) == [
        "gpu1: gpufleet_model_ref is deprecated (fix: rename it gpufleet_model_sha; it means the same)"
    ]
    assert renamed_settings("gpu1", {"gpufleet_model_sha": sha}) == []


def test_an_image_ref_of_the_same_repository_is_kept_as_its_digest_ref():
    ref = "docker.io/vllm/vllm-openai@sha256:" + "a" * 64
    settings = resolve_host("gpu1", {"gpufleet_image_ref": ref})[1]
    assert settings.image_ref == "vllm/vllm-openai@sha256:" + "a" * 64
