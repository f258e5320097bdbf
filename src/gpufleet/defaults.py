"""Every user setting and its default: the contract of host data, documented in README.md's settings table.
Host data wins over group data, which wins over these; FROM_PROFILE ones come from the host's profile.
"""

from __future__ import annotations

from typing import Any, Final, Literal, get_args


class _FromProfile:
    """The default of a setting the host's profile supplies."""

    def __repr__(self) -> str:
        return "FROM_PROFILE"


FROM_PROFILE: Final = _FromProfile()

DEFAULTS: dict[str, Any] = {
    # The vLLM service
    "vllm_profile": "qwen35",
    "vllm_image": "vllm/vllm-openai:nightly",
    "vllm_gpus": FROM_PROFILE,
    "vllm_port": 5000,
    "vllm_publish_address": None,
    "vllm_model": FROM_PROFILE,
    "vllm_model_repo": FROM_PROFILE,
    "vllm_model_revision": FROM_PROFILE,
    "vllm_hf_endpoint": "https://huggingface.co",
    "vllm_models_dir": "/srv/vllm/models",  # absolute: systemd does not expand ~
    "vllm_cache_dir": FROM_PROFILE,
    "vllm_args": {},
    "vllm_env": {},
    "vllm_docker_options": {},
    "vllm_service": FROM_PROFILE,
    # Secrets go to a root-only env file, never into a unit or an argv.
    "vllm_hf_token": None,
    "vllm_api_key": None,
    "vllm_secret_env": {},
    "vllm_ready_timeout": 1800,
    "vllm_ready_soak_s": 20,
    # A replica group (docs/multi-node.md)
    "vllm_group": None,
    "vllm_group_port": 29501,
    "vllm_group_address": None,
    "vllm_group_interface": None,
    "vllm_group_link": None,
    "vllm_fetch_timeout_s": 14400,
    # Host preflight
    "gpufleet_min_cuda": "13.0",
    "gpufleet_min_free_gb_docker": 60,
    "gpufleet_min_free_gb_models": 40,
    "gpufleet_allow_no_gpu": False,
    # GPU health (docs/gpu-health.md)
    "gpufleet_gpu_verdicts": {},
    "gpufleet_gpu_cleared_at": None,
    # The host lock
    "gpufleet_lock_wait_s": 0,
    "gpufleet_lock_lease_s": 90,
    # What one run does: a rollout passes these with `--data key=value`
    "gpufleet_image_ref": None,
    "gpufleet_model_sha": None,
    "gpufleet_stage": "converge",
    "gpufleet_retry_failed": False,
    "gpufleet_expect_committed": None,
    "gpufleet_verify_probe": False,
    "gpufleet_verify_checks": ("cached-cold", "sessions", "tools", "reasoning"),
    "gpufleet_speed_tolerance": 0.7,
    "gpufleet_speed_baseline": None,
    "gpufleet_speed_batches": False,
    "gpufleet_refresh_keys": False,
    # `gpufleet lint`
    "gpufleet_accept": [],
    # Docker engine and NVIDIA container toolkit
    "docker_install": "docker-ce",
    "docker_repo_url": "https://download.docker.com/linux",
    "nvidia_repo_url": "https://nvidia.github.io/libnvidia-container",
    # Site cache (docs/site-cache.md)
    "site_cache_port": 5001,  # not vllm_port: a GPU box may be both
    "site_cache_internal_port": 5002,
    "site_cache_clients": [],
    "site_cache_max_gb": 100,
    "site_cache_upstream": "",
    "site_cache_address": "",
    "site_cache_mirror_port": 5003,
    "site_cache_model_max_gb": 500,
    "site_cache_mirror_index_url": "https://pypi.org/simple",
    "site_cache_pull_timeout_s": 7200,
}

PROFILE_SETTINGS = frozenset(name for name, value in DEFAULTS.items() if value is FROM_PROFILE)

# Never rendered into units, argv, logs or `gpufleet render` output.
SECRET_SETTINGS = frozenset({"vllm_hf_token", "vllm_api_key", "vllm_secret_env"})

# The settings code passes by name (a rollout's `--data key=value`, the lock, lint), spelled once.
IMAGE_REF_SETTING: Final = "gpufleet_image_ref"
MODEL_SHA_SETTING: Final = "gpufleet_model_sha"
STAGE_SETTING: Final = "gpufleet_stage"
RETRY_SETTING: Final = "gpufleet_retry_failed"
EXPECT_COMMITTED_SETTING: Final = "gpufleet_expect_committed"
VERIFY_PROBE_SETTING: Final = "gpufleet_verify_probe"
VERIFY_CHECKS_SETTING: Final = "gpufleet_verify_checks"
SPEED_TOLERANCE_SETTING: Final = "gpufleet_speed_tolerance"
SPEED_BASELINE_SETTING: Final = "gpufleet_speed_baseline"
SPEED_BATCHES_SETTING: Final = "gpufleet_speed_batches"
REFRESH_KEYS_SETTING: Final = "gpufleet_refresh_keys"
WAIT_SETTING: Final = "gpufleet_lock_wait_s"
LEASE_SETTING: Final = "gpufleet_lock_lease_s"
ACCEPT_SETTING: Final = "gpufleet_accept"
GPU_VERDICTS_SETTING: Final = "gpufleet_gpu_verdicts"
GPU_CLEARED_SETTING: Final = "gpufleet_gpu_cleared_at"

# Old name -> new: the old is still read as the new, with a one-line warning (README.md, "Renamed settings").
RENAMED_SETTINGS: Final = {"gpufleet_model_ref": MODEL_SHA_SETTING}

# "prepare" pulls, fetches the model and checks the flags, and stops before the unit (docs/rollout.md).
Stage = Literal["converge", "prepare"]
STAGES: Final[tuple[Stage, ...]] = get_args(Stage)
