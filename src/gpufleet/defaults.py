"""Every user-facing setting, with its default and why. This is the public contract of host data.

Set any of these per host in the inventory, or fleet-wide in inventories/group_data/all.py; host data wins over
group data, which wins over these defaults. README.md's settings table is checked against this dict by a test
(tests/unit/test_readme_settings.py), so a setting added here must be documented there.
"""

from __future__ import annotations

from typing import Any

DEFAULTS: dict[str, Any] = {
    # --- the vLLM service -------------------------------------------------------------------------------------
    # Which profile supplies the run options, env vars, mounts and vLLM flags (gpufleet.profiles).
    "vllm_profile": "qwen35",
    # Image to serve; a tag is resolved to a digest at deploy time and the unit runs that digest.
    "vllm_image": "vllm/vllm-openai:nightly",
    # GPU indexes handed to the container (docker --gpus device=...). Their count must equal DP x TP x PP.
    "vllm_gpus": [0, 1, 2],
    # Port vLLM listens on inside the container and is published on the host.
    "vllm_port": 5000,
    # Host address vllm_port is published on: None = every interface, "127.0.0.1" keeps the API off the network
    # (clients on the host or through an SSH tunnel; gpufleet's own checks go through SSH).
    "vllm_publish_address": None,
    # Model directory name under vllm_models_dir; also the served model name unless vllm_args overrides it.
    "vllm_model": "qwen3.5-awq",
    # Hugging Face repo the model is downloaded from when it is missing; None means it must be staged by hand.
    "vllm_model_repo": "cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit",
    # Hugging Face revision (branch, tag or commit) to pin the download to; None = the repo's default branch.
    "vllm_model_revision": None,
    # Host directory holding models; mounted at /models. Absolute: systemd does not expand ~.
    "vllm_models_dir": "/srv/vllm/models",
    # Host directory holding the vLLM compile cache, torch cache, NVIDIA ComputeCache and HF cache subdirs.
    "vllm_cache_dir": "/var/cache/vllm/qwen35",
    # vLLM flags over the profile's: name without dashes -> value; True = bare flag; None removes a profile flag.
    "vllm_args": {},
    # Container env vars over the profile's: name -> value; None removes a profile variable.
    "vllm_env": {},
    # docker run options over the profile's: name without dashes -> value; True = bare flag, a list repeats
    # the option, None removes a profile option (e.g. {"privileged": None}, see `gpufleet lint`).
    "vllm_docker_options": {},
    # Name of the systemd unit (<name>.service) and of the container label that marks its container.
    "vllm_service": "vllm-qwen35",
    # Secret: Hugging Face token for gated/private models. Kept in a root-only env file, never in a unit or argv.
    "vllm_hf_token": None,
    # Secret: API key clients must send; given to vLLM as VLLM_API_KEY through a root-only env file.
    "vllm_api_key": None,
    # Secrets: extra env vars for the container (name -> value, e.g. {"WANDB_API_KEY": "..."}). Values go to the
    # root-only env file like the API key; the container gets `-e NAME` only, never the value on a command line.
    "vllm_secret_env": {},
    # Seconds the deploy waits for /health and /v1/models to answer after a (re)start; a cold compile is slow.
    "vllm_ready_timeout": 1800,
    # Seconds the deploy keeps checking a service after it first got ready following a (re)start: an engine that
    # dies right after start fails the deploy (and rolls back) instead of the first client. 0 turns it off.
    "vllm_ready_soak_s": 20,
    # --- host preflight -------------------------------------------------------------------------------------
    # Lowest CUDA version the driver must support (the nightly image is CUDA 13.0: R580-class drivers).
    "gpufleet_min_cuda": "13.0",
    # Free space (GiB) required where Docker keeps its images (the nightly is ~28 GB unpacked).
    "gpufleet_min_free_gb_docker": 60,
    # Free space (GiB) required in vllm_models_dir when the model still has to be downloaded.
    "gpufleet_min_free_gb_models": 40,
    # Allow a host without NVIDIA GPUs (a VM for trying the deploy): everything is installed, the service is not
    # started.
    "gpufleet_allow_no_gpu": False,
    # --- Docker engine --------------------------------------------------------------------------------------
    # "docker-ce" from Docker's official repo, or "distro" for the distribution's docker.io package.
    "docker_install": "docker-ce",
    # Base URL of Docker's apt repo (the OS id and codename are appended, as Docker documents).
    "docker_repo_url": "https://download.docker.com/linux",
    # --- NVIDIA container toolkit ---------------------------------------------------------------------------
    # Base URL of NVIDIA's libnvidia-container repo (gpgkey and stable/deb/ live under it).
    "nvidia_repo_url": "https://nvidia.github.io/libnvidia-container",
}

# Settings whose values are secrets: never rendered into units, argv, logs or `gpufleet render` output.
SECRET_SETTINGS = frozenset({"vllm_hf_token", "vllm_api_key", "vllm_secret_env"})
