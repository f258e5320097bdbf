"""What a profile is: a known-good service definition (model, GPUs, docker run options, env, vLLM flags)."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

# Parent of every profile's cache dir: vllm_cache_dir defaults to CACHE_ROOT/<cache_subdir>, so two profiles on
# one host never share a compile cache (it is keyed by vLLM version, not by model or flags).
CACHE_ROOT = "/var/cache/vllm"
# JIT caches a GPU image writes outside vLLM's own cache dir, under the container's HOME (/root): (variable, where
# its cache goes given the variable's value, default value). vLLM moves Triton's and inductor's into its compile dir
# only once it compiles; FlashInfer keeps <FLASHINFER_WORKSPACE_BASE>/.cache/flashinfer (docs/profiles.md).
JIT_CACHES = (("TRITON_CACHE_DIR", "{}", "/root/.triton/cache"),
              ("FLASHINFER_WORKSPACE_BASE", "{}/.cache/flashinfer", "/root"))
# Where they go instead: inside the vLLM cache mount, so restarts keep them and the rollout carries them.
JIT_REDIRECTS = {"TRITON_CACHE_DIR": "/root/.cache/vllm/triton",
                 "FLASHINFER_WORKSPACE_BASE": "/root/.cache/vllm/flashinfer"}
# Values as a user would write them in vllm_docker_options / vllm_args; settings.py validates and renders them.
DockerOptionDefault = bool | str | list[str]
VllmArgDefault = bool | int | float | str


@dataclass(frozen=True)
class Profile:
    name: str
    # --- the defaults of the settings a profile owns (host data, then group data, win over them) -------------
    model: str  # vllm_model: directory name under vllm_models_dir, and the served model name
    model_repo: str | None  # vllm_model_repo: Hugging Face repo to download from; None = staged by hand
    model_revision: str | None  # vllm_model_revision: branch, tag or commit; None = the repo's default branch
    service: str  # vllm_service: systemd unit and container label name
    cache_subdir: str  # last component of vllm_cache_dir
    gpus: tuple[int, ...]  # vllm_gpus: their count must equal DP x TP x PP in vllm_args
    # --- what the container runs -----------------------------------------------------------------------------
    # docker run options in order; value True = bare flag, str = "--name=value", list = repeated "--name v".
    # "runtime" always renders first and --gpus right after it, as in the published invocation.
    docker_options: dict[str, DockerOptionDefault]
    env: dict[str, str]
    # container paths of the mounts; host paths come from the settings (see settings.py).
    models_mount: str
    cache_mounts: dict[str, str]  # subdirectory of vllm_cache_dir -> container path
    # vLLM flags in order. "{model_path}", "{served_model_name}" and "{port}" are filled from the settings.
    vllm_args: dict[str, VllmArgDefault]
    hybrid: bool  # linear-attention (Mamba/GDN) + attention layers: prefix caching needs align mode
    native: bool  # architecture supported by vLLM itself: --trust-remote-code is unnecessary
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def settings(self) -> dict[str, Any]:
        """The settings this profile supplies defaults for, by setting name (a fresh dict: callers may keep it)."""
        return {
            "vllm_gpus": list(self.gpus),
            "vllm_model": self.model,
            "vllm_model_repo": self.model_repo,
            "vllm_model_revision": self.model_revision,
            "vllm_service": self.service,
            "vllm_cache_dir": posixpath.join(CACHE_ROOT, self.cache_subdir),
        }
