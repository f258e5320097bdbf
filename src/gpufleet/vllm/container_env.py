"""vllm_env and vllm_secret_env -> the container's environment.

Plain variables show in `ps` on the docker run line; secret values reach only the root-only env file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gpufleet.errors import shown
from gpufleet.vllm.profiles import Profile
from gpufleet.vllm.value_rules import Fail, check_arg_size, check_secret_value, not_finite, says_secret

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SECRET_ENV = {"VLLM_API_KEY": "vllm_api_key", "HF_TOKEN": "vllm_hf_token", "HUGGING_FACE_HUB_TOKEN": "vllm_hf_token"}
# The env file is also the environment of the docker CLI and the unit's root shells: these names would change them.
_HOST_ENV = frozenset(
    {
        "PATH",
        "IFS",
        "ENV",
        "BASH_ENV",
        "HOME",
        "SHELL",
        "NOTIFY_SOCKET",
        "LISTEN_FDS",
        "LISTEN_PID",
        "LISTEN_FDNAMES",
        "TMPDIR",
        "CDPATH",
    }
)
_HOST_ENV_PREFIXES = ("LD_", "DOCKER_", "SYSTEMD_", "CONTAINERD_", "BUILDKIT_")


def merge_env(profile: Profile, overrides: Any, fail: Fail) -> dict[str, str]:
    merged = dict(profile.env)
    if not isinstance(overrides, Mapping):
        fail("vllm_env", f"{shown(overrides)} is not a mapping", 'use e.g. {"OMP_NUM_THREADS": "8"}')
        return merged
    for name, value in overrides.items():
        setting = f"vllm_env[{name!r}]"
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            fail(setting, "is not an environment variable name", "use letters, digits and '_'")
        elif name in _SECRET_ENV:
            fail(setting, "is a secret and would land in the unit and `ps`", f"set {_SECRET_ENV[name]} instead")
        elif says_secret(name):
            fail(
                setting,
                "names a secret, which would land in the unit and `ps`",
                f"set vllm_secret_env['{name}'] instead",
            )
        elif value is None:
            merged.pop(name, None)
        elif isinstance(value, bool) or not isinstance(value, (str, int, float)):
            fail(setting, f"{shown(value)} is not a string or number", 'quote it, e.g. "1"')
        elif isinstance(value, float) and not_finite(value):
            fail(setting, f"{shown(value)} is not a finite number", 'give a finite number or a string, e.g. "0.5"')
        elif check_arg_size(setting, f"{name}={value}", fail):
            merged[name] = str(value)
    return merged


def check_secret_env(value: Any, env: Mapping[str, str], fail: Fail) -> tuple[str, ...]:
    """Names of the extra secrets, which the container gets as `-e NAME`."""
    if not isinstance(value, Mapping):
        fail("vllm_secret_env", "is not a mapping (value not shown)", 'use e.g. {"WANDB_API_KEY": "..."}')
        return ()
    names = []
    for name, secret in value.items():
        setting = f"vllm_secret_env[{name!r}]"
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            fail(setting, "is not an environment variable name", "use letters, digits and '_'")
        elif name in _SECRET_ENV:
            fail(setting, f"is set by {_SECRET_ENV[name]}", f"set {_SECRET_ENV[name]} instead")
        elif name in _HOST_ENV or name.startswith(_HOST_ENV_PREFIXES):
            fail(
                setting,
                "would also be the environment of the docker CLI and shells the unit runs as root",
                "use a name of the container's own, e.g. WANDB_API_KEY",
            )
        elif name in env:
            fail(
                setting,
                "is also a plain env var (vllm_env or the profile), which would show its value",
                f"remove it there: vllm_env {{'{name}': None}}",
            )
        elif check_secret_value(setting, secret, fail):
            names.append(name)
    return tuple(names)
