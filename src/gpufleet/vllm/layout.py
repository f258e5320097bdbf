"""Where one vLLM service lives on a host, and the paths each operation module manages.

The snapshot reads every managed path, or the file would be uploaded on every run.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

from gpufleet.hoststate.paths import ledger_path
from gpufleet.units import unit_path
from gpufleet.vllm.spec import ServeSpec
from gpufleet.vllm.unit import env_file_path

HF_CACHE_SUBDIR = "huggingface"  # under vllm_cache_dir


def model_dir(spec: ServeSpec) -> str:
    """The host directory of --model's path."""
    mount = spec.model_mount
    return posixpath.join(posixpath.normpath(mount.host_path), posixpath.relpath(spec.model_path, mount.container_path))


@dataclass(frozen=True)
class Layout:
    service: str
    models_dir: str  # host side of the model mount
    model_dir: str
    cache_dirs: tuple[str, ...]  # host side of the cache mounts
    hf_cache: str  # no serving container mounts it

    @classmethod
    def of(cls, spec: ServeSpec, cache_dir: str) -> Layout:
        mount = spec.model_mount
        hf_cache = posixpath.join(posixpath.normpath(cache_dir), HF_CACHE_SUBDIR)
        caches = tuple(posixpath.normpath(m.host_path) for m in spec.mounts if m != mount)
        return cls(
            service=spec.service,
            models_dir=posixpath.normpath(mount.host_path),
            model_dir=model_dir(spec),
            cache_dirs=caches,
            hf_cache=hf_cache,
        )

    @property
    def unit_file(self) -> str:
        return unit_path(self.service)

    @property
    def env_file(self) -> str:
        return env_file_path(self.service)

    @property
    def ledger_path(self) -> str:
        return ledger_path(self.service)


@dataclass(frozen=True)
class Managed:
    """Paths an operation module writes: files compared by sha256, directories by owner and mode."""

    files: tuple[str, ...] = ()
    dirs: tuple[str, ...] = ()

    @staticmethod
    def union(parts: Iterable[Managed]) -> Managed:
        files: dict[str, None] = {}
        dirs: dict[str, None] = {}
        for part in parts:
            files.update(dict.fromkeys(part.files))
            dirs.update(dict.fromkeys(part.dirs))
        return Managed(tuple(files), tuple(dirs))
