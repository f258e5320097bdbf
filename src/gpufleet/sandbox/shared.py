"""The cache entries every fleet shares, built ahead of any fleet by `.ci/run` before the venv exists: stdlib only."""

from __future__ import annotations

from pathlib import Path

from gpufleet.sandbox import docker_repo, image, rootfs
from gpufleet.sandbox.config import CACHE_DIR


def build(cache_dir: Path = CACHE_DIR) -> None:
    base = rootfs.ensure_base(cache_dir)
    docker_repo.ensure_repo(cache_dir, base.debs)
    image.image_tar(cache_dir, base.rootfs)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    build()
