"""Every user-facing setting, with its default and why. This is the public contract of host data.

Set any of these per host in the inventory, or fleet-wide in inventories/group_data/all.py; host data wins over
group data, which wins over these defaults. The settings marked FROM_PROFILE depend on the model: their default is
the host's profile's (gpufleet.vllm.profiles, Profile.settings), merged by gpufleet.vllm.settings.merged_settings. README.md's
settings table is checked against this dict by a test (tests/unit/test_readme_settings.py), so a setting added here
must be documented there.
"""

from __future__ import annotations

from typing import Any, Final, Literal, get_args


class _FromProfile:
    """The default of a setting the host's profile supplies (never a value a host ends up with)."""

    def __repr__(self) -> str:
        return "FROM_PROFILE"


FROM_PROFILE: Final = _FromProfile()

DEFAULTS: dict[str, Any] = {
    # --- the vLLM service -------------------------------------------------------------------------------------
    # Which profile supplies the run options, env vars, mounts and vLLM flags, and the defaults of the settings
    # marked FROM_PROFILE (gpufleet.vllm.profiles; docs/profiles.md lists them).
    "vllm_profile": "qwen35",
    # Image to serve; a tag is resolved to a digest at deploy time and the unit runs that digest.
    "vllm_image": "vllm/vllm-openai:nightly",
    # GPU indexes handed to the container (docker --gpus device=...). Their count must equal DP x TP x PP.
    "vllm_gpus": FROM_PROFILE,
    # Port vLLM listens on inside the container and is published on the host.
    "vllm_port": 5000,
    # Host address vllm_port is published on: None = every interface, "127.0.0.1" keeps the API off the network
    # (clients on the host or through an SSH tunnel; gpufleet's own checks go through SSH).
    "vllm_publish_address": None,
    # Model directory name under vllm_models_dir; also the served model name unless vllm_args overrides it.
    "vllm_model": FROM_PROFILE,
    # Hugging Face repo the model is downloaded from when it is missing; None means it must be staged by hand.
    "vllm_model_repo": FROM_PROFILE,
    # Hugging Face revision (branch, tag or commit) to pin the download to; None = the repo's default branch. A
    # branch or tag is resolved to a commit once: the ledger keeps it until this setting changes or a rollout moves it.
    "vllm_model_revision": FROM_PROFILE,
    # The Hugging Face hub (or a hub of the same API): the model's commit and every file's hash come from it, and the
    # files too unless the site cache mirrors them (docs/site-cache.md).
    "vllm_hf_endpoint": "https://huggingface.co",
    # Host directory holding models; mounted at /models. Absolute: systemd does not expand ~.
    "vllm_models_dir": "/srv/vllm/models",
    # Host directory holding the vLLM compile cache, torch cache, NVIDIA ComputeCache and HF cache subdirs;
    # the profile's default is /var/cache/vllm/<profile's cache subdir>.
    "vllm_cache_dir": FROM_PROFILE,
    # vLLM flags over the profile's: name without dashes -> value; True = bare flag; None removes a profile flag.
    "vllm_args": {},
    # Container env vars over the profile's: name -> value; None removes a profile variable.
    "vllm_env": {},
    # docker run options over the profile's: name without dashes -> value; True = bare flag, a list repeats
    # the option, None removes a profile option (e.g. {"privileged": None}, see `gpufleet lint`).
    "vllm_docker_options": {},
    # Name of the systemd unit (<name>.service) and of the container label that marks its container.
    "vllm_service": FROM_PROFILE,
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
    # --- a replica group: one model across hosts (docs/multi-node.md) -----------------------------------------
    # The name of the inventory group whose hosts serve one model together; set it in that group's data. The
    # group's hosts in its order are the ranks: the first (the head) serves the API, the others run headless.
    # Pipeline parallel spans the hosts, tensor parallel stays within each. None: a replica of its own.
    "vllm_group": None,
    # The head's port the ranks join at (vLLM's --master-port).
    "vllm_group_port": 29501,
    # This host's IP address on the group's network (VLLM_HOST_IP; the head's is --master-addr). None: its
    # ssh_hostname, which must then be an IP address.
    "vllm_group_address": None,
    # The network interface of the group's traffic on this host (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME). None lets
    # Gloo and NCCL pick one, often the wrong one (`gpufleet lint` warns).
    "vllm_group_interface": None,
    # The link between the group's hosts, stated for the record (e.g. "25GbE", "100GbE RoCE"): every token's
    # activations cross it. None: `gpufleet lint` warns.
    "vllm_group_link": None,
    # Seconds one `docker pull` of the image from its registry, and the model download, may take before the run ends
    # it and fails the host on one line: a registry or hub that stops answering must not hold the host's lock forever.
    "vllm_fetch_timeout_s": 14400,
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
    # --- GPU health (docs/gpu-health.md) ------------------------------------------------------------------------
    # Rows of the GPU verdict table over its defaults: signal -> "ok", "degraded", "restart-app", "reset-gpu",
    # "reboot" or "service", e.g. {"xid 43": "ok"}. reset-gpu and worse refuse a (re)start on that GPU.
    "gpufleet_gpu_verdicts": {},
    # ISO 8601 time with its zone: kernel log Xid lines before it no longer count (set it after resetting a GPU by
    # hand whose Xid the driver's own fields cannot clear). None: every line since boot counts.
    "gpufleet_gpu_cleared_at": None,
    # --- one run per host at a time ---------------------------------------------------------------------------
    # Seconds a run waits for another run's lock on a host before preflight refuses it; 0 refuses at once, naming
    # the holder (user, controller host, pid, since when).
    "gpufleet_lock_wait_s": 0,
    # Seconds a host keeps a run's lock without hearing from its controller (heartbeats come every quarter of it):
    # a lock left by a controller that froze or lost its link frees itself after this. A killed controller's lock
    # frees at once.
    "gpufleet_lock_lease_s": 90,
    # --- what one run does (a rollout passes these with `--data key=value`) ---------------------------------
    # A digest "repo@sha256:<64 hex>" of vllm_image's repository to install instead of resolving vllm_image: pulled
    # by digest if absent. The host's ledger records it under vllm_image, so a later converge without this setting
    # keeps running it with no change.
    "gpufleet_image_ref": None,
    # A commit of vllm_model_repo to install instead of the one the ledger keeps: what a rollout passes to move the
    # model (a branch it resolved at its start). Recorded in the ledger, so a later converge keeps it.
    "gpufleet_model_ref": None,
    # "converge" does everything; "prepare" stops before the unit: preflight, engine, toolkit, directories, env
    # file, the image pull, the model and the image's flag check, while the old version keeps serving (no unit
    # write, no restart, no ledger change).
    "gpufleet_stage": "converge",
    # A version (digest + spec) that failed verification is not installed again by a plain converge; True tries it
    # again on purpose, for this run.
    "gpufleet_retry_failed": False,
    # {host: the digest its ledger had committed (None: nothing)} as the rollout read it when it started: a host whose
    # ledger says otherwise now (another run changed it meanwhile) is refused before anything changes.
    "gpufleet_expect_committed": None,
    # After ready and the soak, also run the prompt re-processing probe (`gpufleet verify --probe`); its failure is
    # a failed verify (rolled back).
    "gpufleet_verify_probe": False,
    # The serving checks a new version must pass before it is committed, beside a completion plain and streamed
    # (docs/verify.md): a list of names, "all" or "none". Each runs only where the settings give it something to
    # check. "prefix-cache" (the probe, up to 49 requests) is left to gpufleet_verify_probe and a rollout's canary.
    "gpufleet_verify_checks": ("cached-cold", "sessions", "tools", "reasoning"),
    # The speed check (docs/verify.md): how much speed every repeat of a figure may lose against the old version's
    # median on the same host (0.7: down to 0.3x) before the new version fails. Above a version's noise against
    # itself on a loaded machine, below a real regression (measured: docs/verify.md); a GPU host can hold a tighter one.
    "gpufleet_speed_tolerance": 0.7,
    # {host: the old version's speed figures} as a rollout measured them before the swap: what the speed check holds
    # the new version to. Unset, the check records the new figures without comparing.
    "gpufleet_speed_baseline": None,
    # A rollout holds the hosts after its canary to the speed check too (each measured before and after its swap),
    # not only the canary.
    "gpufleet_speed_batches": False,
    # Fetch the Docker and NVIDIA repo keys even where a keyring is installed, and replace a key that rotated. Off,
    # an installed key stands (no request leaves the host) until apt installs from its repo, which fetches it first.
    "gpufleet_refresh_keys": False,
    # --- gpufleet lint --------------------------------------------------------------------------------------
    # Lint rule ids this host (or group) accepts on purpose, e.g. ["open-without-api-key"]: `gpufleet lint` lists
    # them as accepted and leaves them out of its exit status. Say why in a comment next to it (docs/lint.md).
    "gpufleet_accept": [],
    # --- Docker engine --------------------------------------------------------------------------------------
    # "docker-ce" from Docker's official repo, or "distro" for the distribution's docker.io package.
    "docker_install": "docker-ce",
    # Base URL of Docker's apt repo (the OS id and codename are appended, as Docker documents).
    "docker_repo_url": "https://download.docker.com/linux",
    # --- NVIDIA container toolkit ---------------------------------------------------------------------------
    # Base URL of NVIDIA's libnvidia-container repo (gpgkey and stable/deb/ live under it).
    "nvidia_repo_url": "https://nvidia.github.io/libnvidia-container",
    # --- site cache: one download per site (docs/site-cache.md) ------------------------------------------------
    # The inventory group `site_cache` names the host that runs it (Debian's docker-registry as a pull-through
    # cache); every other host pulls a digest known before the pull (a rollout's, a pinned one) through it first.
    # Port the site cache listens on (on the site_cache host). Not vllm_port: a GPU box may be both. nginx there
    # serves only pulls by digest of the inventory's repositories, to the inventory's hosts.
    "site_cache_port": 5001,
    # The cache's registry itself, on the site_cache host's loopback, behind that nginx.
    "site_cache_internal_port": 5002,
    # Addresses or networks ("10.0.1.0/24") that may pull through the site cache besides the inventory's hosts,
    # e.g. another site's hosts whose site_cache_address names it.
    "site_cache_clients": [],
    # GB the site cache may hold: preflight wants room for it on the site_cache host, and a converge of that host
    # that finds the cache over it empties the cache before its pull.
    "site_cache_max_gb": 100,
    # Registry the site cache proxies: "" = vllm_image's registry (https://registry-1.docker.io for Docker Hub).
    # One cache proxies one registry: a host whose vllm_image comes from another pulls from it directly.
    "site_cache_upstream": "",
    # Where this host pulls through: "" = the inventory's site_cache host (its ssh_hostname) at its
    # site_cache_port, "host:port" another cache (a second site), "off" = never.
    "site_cache_address": "",
    # The site cache's mirror of the Hugging Face hub (olah, for the inventory's vllm_model_repos), on the site_cache
    # host's loopback behind the same nginx: hosts download the model through site_cache_port.
    "site_cache_mirror_port": 5003,
    # GB the model mirror may keep; past it, what was read least recently goes first (olah checks hourly).
    "site_cache_model_max_gb": 500,
    # Package index the model mirror's locked wheels come from (each checked against the lock's sha256).
    "site_cache_mirror_index_url": "https://pypi.org/simple",
    # Seconds a pull through the site cache may take before the host pulls from upstream instead. The first host
    # of a site pulls through the cache at upstream speed (the cache fetches as it serves).
    "site_cache_pull_timeout_s": 7200,
}

# Settings whose default the host's profile supplies.
PROFILE_SETTINGS = frozenset(name for name, value in DEFAULTS.items() if value is FROM_PROFILE)

# Settings whose values are secrets: never rendered into units, argv, logs or `gpufleet render` output.
SECRET_SETTINGS = frozenset({"vllm_hf_token", "vllm_api_key", "vllm_secret_env"})

# The names of the settings that code passes or reads by name (a rollout's `--data key=value`, the deploy, the lock,
# lint): spelled here once, each a key of DEFAULTS.
IMAGE_REF_SETTING: Final = "gpufleet_image_ref"
MODEL_REF_SETTING: Final = "gpufleet_model_ref"
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

# The values of STAGE_SETTING: "converge" is the whole deploy; "prepare" pulls, fetches the model and checks the flags,
# and stops before the unit (nothing restarts; the rollout prepares every host before it swaps any).
Stage = Literal["converge", "prepare"]
STAGES: Final[tuple[Stage, ...]] = get_args(Stage)
