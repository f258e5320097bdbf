"""What a fleet is made of: names, subnet, state and cache places, and each host's GPUs.

Every name a fleet creates derives from here, so fleets run side by side.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.sandbox import nvidia_smi

CACHE_DIR = Path(os.environ.get("GPUFLEET_CACHE_DIR", "/var/cache/gpufleet"))
MIRROR_PORT = 8080
REGISTRY_PORT = 5000
HUB_PORT = 8081  # the stand-in Hugging Face hub
MAX_BRIDGE_NAME = 11


@dataclass(frozen=True)
class Gpus:
    """A host's GPUs as its nvidia-smi reports them; count=0 is a box without the driver."""

    count: int = 3
    model: str = "NVIDIA H200"
    memory_mib: int | None = None  # None: as recorded, for these three
    driver: str | None = None
    cuda: str | None = None
    hang: bool = False  # a wedged driver

    def profile(self, seed: str) -> nvidia_smi.Profile | None:
        if self.count == 0:
            return None
        profile = nvidia_smi.make_profile(
            self.count, model=self.model, memory_mib=self.memory_mib, driver=self.driver, cuda=self.cuda, seed=seed
        )
        profile.hang = self.hang
        return profile


H200x3 = Gpus(3)  # the write-up's box
H200x8 = Gpus(8)
H200x1 = Gpus(1)
OLD_DRIVER = Gpus(3, driver="535.104.05", cuda="12.2")  # too old for the CUDA 13 nightly image
NO_GPU = Gpus(0)


@dataclass(frozen=True)
class FleetConfig:
    name: str  # short: part of netns names
    bridge: str
    net: str  # first three octets of the /24
    host_prefix: str
    state_dir: Path
    cache_dir: Path = field(default=CACHE_DIR)

    def __post_init__(self) -> None:
        # Interface names have at most 15 characters (IFNAMSIZ).
        if len(self.bridge) > MAX_BRIDGE_NAME:
            raise ValueError(
                f"fleet {self.name}: bridge name {self.bridge!r} is longer than {MAX_BRIDGE_NAME} "
                f"characters (fix: a shorter one, so its hosts' links <bridge>-<i> fit 15)"
            )

    @property
    def gateway(self) -> str:
        return f"{self.net}.1"

    @property
    def subnet(self) -> str:
        return f"{self.net}.0/24"

    def host_name(self, i: int) -> str:
        return f"{self.host_prefix}{i}"

    def host_ip(self, i: int) -> str:
        return f"{self.net}.{10 + i}"

    def netns(self, host: str) -> str:
        return f"gf-{self.name}-{host}"

    def veth(self, i: int) -> str:
        return f"{self.bridge}-{i}"[:15]  # IFNAMSIZ

    @property
    def registry(self) -> str:
        return f"{self.gateway}:{REGISTRY_PORT}"

    @property
    def mirror_url(self) -> str:
        return f"http://{self.gateway}:{MIRROR_PORT}"

    @property
    def nvidia_repo_url(self) -> str:
        return f"{self.mirror_url}/nvidia"

    @property
    def router_index_url(self) -> str:
        """The PEP 503 index of the real vllm-router wheels."""
        return f"{self.mirror_url}/pypi/simple"

    @property
    def hub_url(self) -> str:
        return f"http://{self.gateway}:{HUB_PORT}"

    @property
    def docker_repo_url(self) -> str:
        """Like https://download.docker.com/linux, the OS id follows."""
        return f"{self.mirror_url}/docker/linux"


def sandbox_config() -> FleetConfig:
    return FleetConfig(
        name="sandbox",
        bridge="gf-sandbox",
        net="10.213.0",
        host_prefix="gpuhost",
        state_dir=Path(os.environ.get("GPUFLEET_SANDBOX_DIR", "/var/lib/gpufleet/sandbox")),
    )


def test_config(state_dir: Path | None = None) -> FleetConfig:
    return FleetConfig(
        name="test",
        bridge="gf-test",
        net="10.213.1",
        host_prefix="gft",
        state_dir=state_dir or Path("/var/lib/gpufleet/test"),
    )
