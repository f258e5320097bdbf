"""vllm_docker_options -> the options of the unit's `docker run`, over the profile's (docs/hardening.md)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gpufleet.errors import shown
from gpufleet.vllm.profiles import Profile
from gpufleet.vllm.spec import OptionValue
from gpufleet.vllm.value_rules import Fail, check_arg_size

_OPTION_NAME = re.compile(r"[a-z][a-z0-9-]*")
# Options the unit and the spec own, short forms too.
_PORT, _ENV, _LABEL = "use vllm_port", "use vllm_env (secrets: vllm_secret_env)", "use vllm_service"
_VOLUMES = "use vllm_models_dir / vllm_cache_dir"
_FOREGROUND = "remove it: systemd supervises the container in the foreground"
_NO_TTY = "remove it: systemd runs the container without a terminal"
_OPTIONS_OWNED = {
    "gpus": "use vllm_gpus",
    "publish": _PORT,
    "p": _PORT,
    "publish-all": _PORT,
    "P": _PORT,
    "env": _ENV,
    "e": _ENV,
    "env-file": "use vllm_secret_env (the unit's root-only env file)",
    "volume": _VOLUMES,
    "v": _VOLUMES,
    "mount": _VOLUMES,
    "volumes-from": _VOLUMES,
    "label": _LABEL,
    "l": _LABEL,
    "label-file": _LABEL,
    "name": _LABEL,
    "rm": "remove it: --rm is always set",
    "cidfile": "remove it: the container is found by its label",
    "restart": "remove it: systemd restarts the service (Restart=on-failure)",
    "detach": _FOREGROUND,
    "d": _FOREGROUND,
    "interactive": _NO_TTY,
    "i": _NO_TTY,
    "tty": _NO_TTY,
    "t": _NO_TTY,
}
_SHORT_OPTIONS = {"a": "attach", "c": "cpu-shares", "h": "hostname", "m": "memory", "u": "user", "w": "workdir"}


def _option_key(key: Any) -> tuple[str, str]:
    """("env", "--env=A=b") for a key written with its value."""
    text = str(key).lstrip("-")
    return re.split(r"[= ]", text, maxsplit=1)[0], text


def merge_docker_options(profile: Profile, overrides: Any, fail: Fail) -> dict[str, OptionValue]:
    merged: dict[str, OptionValue] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in profile.docker_options.items()
    }
    if not isinstance(overrides, Mapping):
        fail("vllm_docker_options", f"{shown(overrides)} is not a mapping", 'use e.g. {"privileged": None}')
        return merged
    for key, value in overrides.items():
        name, written = _option_key(key)
        setting = f"vllm_docker_options[{key!r}]"
        if name in _OPTIONS_OWNED:
            fail(setting, "is managed by gpufleet", _OPTIONS_OWNED[name])
        elif name != written:
            fail(setting, "puts a value in the option's name", f'write {{"{name}": <value>}}')
        elif not _OPTION_NAME.fullmatch(name):
            fail(setting, "is not a docker run option name", 'use its long name without dashes, e.g. "shm-size"')
        elif len(name) == 1:
            long = _SHORT_OPTIONS.get(name)
            fail(
                setting,
                f"is a one-letter option, which would render as --{name}=",
                f'use its long name, "{long}"' if long else "use its long name (see `docker run --help`)",
            )
        elif value is None:
            merged.pop(name, None)
        elif value is True or (isinstance(value, str) and value):
            if value is True or check_arg_size(setting, f"--{name}={value}", fail):
                merged[name] = value
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
            if all(check_arg_size(setting, v, fail) for v in value):
                merged[name] = tuple(value)
        else:
            fail(setting, f"{shown(value)} is not True, a string or a list of strings", 'e.g. {"shm-size": "16g"}')
    return merged
