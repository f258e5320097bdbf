"""Fleet-wide settings for every host in inventories/*.py (host data overrides these)."""

# How pyinfra logs in: a user with passwordless sudo.
ssh_user = "deploy"
_sudo = True  # pyinfra global argument: every operation runs with sudo

vllm_profile = "qwen35"
vllm_image = "vllm/vllm-openai:nightly"
vllm_models_dir = "/srv/vllm/models"
# The model, its Hugging Face repo, the cache dir and the service name come from each host's profile: set them here
# and every host gets them, whatever its vllm_profile says (a "qwen35-1gpu" host would serve the 3-GPU model and
# share the other service's caches). Override them per host, in lab.py, when a host needs its own.
