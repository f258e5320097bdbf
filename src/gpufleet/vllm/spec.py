"""The serve spec: one frozen, validated description of a vLLM service on one host, and the only place its
`docker run` is built. gpufleet.vllm.settings.build_spec makes one."""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.names import LOOPBACK, container_label_key, url_host
from gpufleet.vllm.group import Member

ArgValue = bool | str  # True = bare flag, False = --no-<flag>, str = the value
OptionValue = bool | str | tuple[str, ...]  # True = bare flag, str = --name=value, tuple = repeated --name v


HF_CACHE_CONTAINER_PATH = "/root/.cache/huggingface"
# A path that exists nowhere: an accepted command line stops at model resolution.
FLAG_CHECK_MODEL = "/gpufleet-flag-check/no-model"


def reach_address(published_on: str | None) -> str:
    """Where a host itself reaches a port published on `published_on`: the loopback, unless bound to one address."""
    return LOOPBACK if published_on in (None, "0.0.0.0", "::") else published_on


@dataclass(frozen=True)
class Mount:
    host_path: str
    container_path: str

    def volume_arg(self) -> str:
        return f"{self.host_path}:{self.container_path}"


@dataclass(frozen=True)
class ServeSpec:
    host: str  # the inventory name, for messages only
    service: str
    image: str  # as configured: a tag or a digest
    gpus: tuple[int, ...]
    port: int
    docker_options: tuple[tuple[str, OptionValue], ...]
    env: tuple[tuple[str, str], ...]
    secret_env_names: tuple[str, ...]  # "-e NAME": the value comes from the root-only env file
    mounts: tuple[Mount, ...]
    vllm_args: tuple[tuple[str, ArgValue], ...]
    hybrid: bool
    native_model: bool
    publish_address: str | None = None
    # Not hashed: what a rank adds is in vllm_args, env and docker_options.
    group: Member | None = None

    @property
    def spec_hash(self) -> str:
        """Stable hash of everything that shapes the container."""
        identity = {
            "service": self.service,
            "image": self.image,
            "gpus": self.gpus,
            "port": self.port,
            "docker_options": self.docker_options,
            "env": self.env,
            "secret_env_names": self.secret_env_names,
            "mounts": [(m.host_path, m.container_path) for m in self.mounts],
            "vllm_args": self.vllm_args,
        }
        if self.publish_address is not None:
            # Only when set: hosts that never set it keep their hash, so upgrading gpufleet restarts nothing.
            identity["publish_address"] = self.publish_address
        canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def container_label_key(self) -> str:
        return container_label_key(self.service)

    @property
    def container_label(self) -> str:
        return f"{self.container_label_key}={self.spec_hash}"

    @property
    def publish_arg(self) -> str:
        """docker's -p value: "5000:5000", "127.0.0.1:5000:5000", "[::1]:5000:5000"."""
        address = self.publish_address
        if address is None:
            return f"{self.port}:{self.port}"
        return f"{url_host(address)}:{self.port}:{self.port}"

    @property
    def reach_address(self) -> str:
        """Where the host itself reaches the published port."""
        return reach_address(self.publish_address)

    def arg(self, name: str) -> ArgValue | None:
        return dict(self.vllm_args).get(name)

    @property
    def model_path(self) -> str:
        return str(self.arg("model"))

    @property
    def model_mount(self) -> Mount:
        """The mount the served model is read from."""
        for mount in self.mounts:
            if posixpath.commonpath([mount.container_path, self.model_path]) == mount.container_path:
                return mount
        raise ValueError(f"{self.host}: --model {self.model_path} is in none of the spec's mounts")

    @property
    def served_model_name(self) -> str:
        return str(self.arg("served-model-name") or self.model_path)

    @property
    def max_model_len(self) -> int | None:
        value = self.arg("max-model-len")
        return parse_token_count(value) if isinstance(value, str) else None

    @property
    def prefix_caching(self) -> bool:
        # On by default in vLLM (hybrids too since 0.28).
        return self.arg("enable-prefix-caching") is not False

    @property
    def mamba_cache_mode(self) -> str | None:
        value = self.arg("mamba-cache-mode")
        if isinstance(value, str):
            return value
        if self.hybrid:
            return "align" if self.prefix_caching else "none"
        return None

    def vllm_argv(self, model: str | None = None) -> list[str]:
        """The vLLM flags; `model` replaces --model's value."""
        argv: list[str] = []
        for name, value in self.vllm_args:
            if name == "model" and model is not None:
                value = model
            if value is True:
                argv.append(f"--{name}")
            elif value is False:
                argv.append(f"--no-{name}")
            else:
                argv += [f"--{name}", value]
        return argv

    def docker_run_argv(self, image: str | None = None, docker: str = "docker", model: str | None = None) -> list[str]:
        """The full `docker run` argv. model: the model's commit (repo@commit), a label of its own."""
        argv = [docker, "run", "--rm", "--label", self.container_label]
        if model:
            argv += ["--label", f"{model_label_key(self.service)}={model}"]
        options = dict(self.docker_options)
        if "runtime" in options:
            argv += _option_args("runtime", options.pop("runtime"))
        # Docker's --gpus takes CSV, so a device list with commas must itself be double-quoted.
        argv += ["--gpus", '"device=' + ",".join(str(g) for g in self.gpus) + '"']
        for name, value in options.items():
            argv += _option_args(name, value)
        if self.group is None:
            argv += ["-p", self.publish_arg]
        for name, value in self.env:
            argv += ["-e", f"{name}={value}"]
        for name in self.secret_env_names:
            argv += ["-e", name]
        for mount in self.mounts:
            argv += ["-v", mount.volume_arg()]
        argv.append(image or self.image)
        return argv + self.vllm_argv()

    def flag_check_argv(self, image: str, name: str, docker: str = "docker") -> list[str]:
        """`vllm serve` of `image` on this spec's flags, with no GPU, network, mounts or secrets."""
        return [
            docker,
            "run",
            "--rm",
            "--name",
            name,
            "--network",
            "none",
            "-e",
            "HF_HUB_OFFLINE=1",
            "-e",
            "VLLM_NO_USAGE_STATS=1",
            image,
            *self.vllm_argv(model=FLAG_CHECK_MODEL),
        ]

    def hf_download_argv(
        self,
        image: str,
        repo: str,
        revision: str | None,
        hf_cache: str | None,
        env_file: str | None,
        docker: str = "docker",
        env: Mapping[str, str] = {},
    ) -> list[str]:
        """The serving image's own hf CLI downloading the model where the service reads it; the token comes only
        through the root-only env_file."""
        # The host's network, as the host's own check of the hub used.
        argv = [docker, "run", "--rm", "--network", "host", "--entrypoint", "hf", "-v", self.model_mount.volume_arg()]
        if hf_cache:
            argv += ["-v", f"{hf_cache}:{HF_CACHE_CONTAINER_PATH}"]
        if env_file:
            argv += ["--env-file", env_file]
        argv += [a for name, value in sorted(env.items()) for a in ("-e", f"{name}={value}")]
        argv += [image, "download", repo, "--local-dir", self.model_path]
        if revision:
            argv += ["--revision", revision]
        return argv


def model_label_key(service: str) -> str:
    """The container label that names the model's commit it was started on."""
    return f"{container_label_key(service)}.model"


def _option_args(name: str, value: OptionValue) -> list[str]:
    if value is True:
        return [f"--{name}"]
    if isinstance(value, tuple):
        return [token for item in value for token in (f"--{name}", item)]
    return [f"--{name}={value}"]


_TOKEN_COUNT = re.compile(r"([0-9]+)([kKmMgG]?)")
_SUFFIX = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_token_count(text: Any) -> int | None:
    """vLLM's token counts: "225000", "32k" (x1000), "32K" (x1024); None if not one."""
    match = _TOKEN_COUNT.fullmatch(str(text).strip())
    if not match:
        return None
    return int(match.group(1)) * _SUFFIX[match.group(2)]
