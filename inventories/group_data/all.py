"""Fleet-wide settings for every host in inventories/*.py (host data overrides these)."""

# How pyinfra logs in: a user with passwordless sudo.
ssh_user = "deploy"
_sudo = True  # pyinfra global argument: every operation runs with sudo

vllm_profile = "qwen35"
vllm_image = "vllm/vllm-openai:nightly"
vllm_models_dir = "/srv/vllm/models"
vllm_cache_dir = "/var/cache/vllm/qwen35"
vllm_model = "qwen3.5-awq"
vllm_model_repo = "cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit"
