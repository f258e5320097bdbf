"""VllmSettings: the typed record of a vLLM host's settings, built once by resolve_host after validation."""

from __future__ import annotations

import dataclasses

import pytest

from gpufleet.defaults import DEFAULTS
from gpufleet.vllm.settings import VllmSettings, field_name, merged_settings, resolve_host


def test_every_setting_has_one_field_named_after_it():
    fields = [f.name for f in dataclasses.fields(VllmSettings)]
    assert sorted(fields) == sorted(field_name(key) for key in DEFAULTS)
    assert (field_name("vllm_cache_dir"), field_name("gpufleet_image_ref"), field_name("site_cache_port")) == (
        "cache_dir",
        "image_ref",
        "site_cache_port",
    )


def test_the_record_holds_the_validated_values_read_only():
    data = {
        "vllm_gpus": [0, 1, 2],
        "vllm_args": {"max-model-len": 32768},
        "gpufleet_retry_failed": "true",
        "vllm_docker_options": {"device": ["/dev/fuse"]},
        "gpufleet_verify_checks": "tools,sessions",
    }
    settings = resolve_host("gpu1", data)[1]
    assert settings.gpus == (0, 1, 2) and settings.retry_failed is True
    assert settings.verify_checks == ("sessions", "tools") and settings.docker_options["device"] == ("/dev/fuse",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.port = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        settings.args["max-model-len"] = 1  # type: ignore[index]
    assert data["vllm_gpus"] == [0, 1, 2]  # the host's data is left as given


def test_unconverted_readers_read_it_by_setting_name():
    settings = resolve_host("gpu1", {"vllm_profile": "qwen35-1gpu"})[1]
    merged = merged_settings({"vllm_profile": "qwen35-1gpu"})
    assert list(settings) == list(DEFAULTS) and len(settings) == len(DEFAULTS)
    assert settings["vllm_service"] == settings.service == merged["vllm_service"]
    assert settings.get("gpufleet_lock_lease_s") == merged["gpufleet_lock_lease_s"]
    assert settings.get("ssh_hostname") is None and "router_policy" not in settings


def test_accepted_lint_rules_keep_their_string_entries():
    assert resolve_host("gpu1", {"gpufleet_accept": ["open-without-api-key", 3]})[1].accept == ("open-without-api-key",)
    assert resolve_host("gpu1", {"gpufleet_accept": "open-without-api-key"})[1].accept == ()


def test_the_record_is_built_by_keyword_only():
    settings = resolve_host("gpu1", {})[1]
    values = [getattr(settings, f.name) for f in dataclasses.fields(VllmSettings)]
    with pytest.raises(TypeError):
        VllmSettings(*values)  # type: ignore[misc]
    assert (
        VllmSettings(**{f.name: v for f, v in zip(dataclasses.fields(VllmSettings), values, strict=True)}) == settings
    )
