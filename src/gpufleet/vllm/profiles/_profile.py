"""What a profile is: a known-good service definition."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

# A cache dir per profile: vLLM keys its compile cache by version, not model.
CACHE_ROOT = "/var/cache/vllm"
# (variable, its cache dir from its value, default) of the caches docs/profiles.md lists.
JIT_CACHES = (
    ("TRITON_CACHE_DIR", "{}", "/root/.triton/cache"),
    ("FLASHINFER_WORKSPACE_BASE", "{}/.cache/flashinfer", "/root"),
)
# Inside the vLLM cache mount.
JIT_REDIRECTS = {
    "TRITON_CACHE_DIR": "/root/.cache/vllm/triton",
    "FLASHINFER_WORKSPACE_BASE": "/root/.cache/vllm/flashinfer",
}
DockerOptionDefault = bool | str | list[str]
VllmArgDefault = bool | int | float | str


@dataclass(frozen=True)
class Profile:
    name: str
    # Defaults of the settings of the same name.
    model: str
    model_repo: str | None  # None: staged by hand
    model_revision: str | None
    service: str
    cache_subdir: str  # last component of vllm_cache_dir
    gpus: tuple[int, ...]
    # In order; True renders a bare flag, a list a repeated one.
    docker_options: dict[str, DockerOptionDefault]
    env: dict[str, str]
    models_mount: str  # container path
    cache_mounts: dict[str, str]  # subdirectory of vllm_cache_dir -> container path
    vllm_args: dict[str, VllmArgDefault]  # "{port}" and the like filled from the settings
    hybrid: bool  # prefix caching needs align mode
    native: bool  # vLLM's own architecture
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def settings(self) -> dict[str, Any]:
        """A fresh dict of this profile's defaults by setting name."""
        return {
            "vllm_gpus": list(self.gpus),
            "vllm_model": self.model,
            "vllm_model_repo": self.model_repo,
            "vllm_model_revision": self.model_revision,
            "vllm_service": self.service,
            "vllm_cache_dir": posixpath.join(CACHE_ROOT, self.cache_subdir),
        }
