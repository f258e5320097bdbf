"""The rules every setting's value is held to, whatever the setting."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from gpufleet.errors import CONTROL_CHARACTERS

# Records one problem: (setting, problem, fix).
Fail = Callable[[str, str, str], None]
# Characters systemd, docker --env-file and sh all read alike unquoted.
SECRET_VALUE = re.compile(r"[A-Za-z0-9._+/=:@-]+")
# Linux's MAX_ARG_STRLEN: execve fails with E2BIG on one longer argument.
MAX_ARG_BYTES = 131072
# Whole words, so TOKENIZERS_PARALLELISM stays plain; any name containing password or secret is one (PGPASSWORD).
_SECRET_WORDS = {"token", "key", "apikey", "secret", "secrets", "password", "passwd", "credential", "credentials"}
_SECRET_PARTS = ("password", "passwd", "secret")


def says_secret(name: str) -> bool:
    """Does a flag or env var name say it carries a secret ("WANDB_API_KEY", "hf-token")?"""
    lowered = name.lower()
    return bool(_SECRET_WORDS.intersection(re.split(r"[-_.]", lowered))) or any(p in lowered for p in _SECRET_PARTS)


def control_character(text: str) -> str | None:
    """ "U+000A" for the first control character in text, None when it has none."""
    found = CONTROL_CHARACTERS.search(text)
    return f"U+{ord(found.group()):04X}" if found else None


def check_secret_value(setting: str, value: Any, fail: Fail, optional: bool = False) -> bool:
    # Never echo the value: messages reach terminals and CI logs.
    if value is None and optional:
        return True
    if not isinstance(value, str) or not value:
        fail(
            setting,
            "must be a non-empty string" + (" or None" if optional else "") + " (value not shown)",
            "set the secret as a string",
        )
        return False
    if not SECRET_VALUE.fullmatch(value):
        fail(
            setting,
            "holds characters an env file cannot carry unquoted (value not shown)",
            "use a value of letters, digits and ._+/=:@- only",
        )
        return False
    return True


def check_arg_size(setting: str, argument: str, fail: Fail) -> bool:
    size = len(argument.encode())
    if size > MAX_ARG_BYTES:
        fail(
            setting,
            f"makes a {size}-byte command-line argument, over Linux's {MAX_ARG_BYTES}-byte limit (execve fails)",
            "shorten it, or put it in a file under vllm_models_dir and pass the path",
        )
        return False
    return True


def not_finite(value: Any) -> bool:
    """nan, inf, "-Infinity", 10**400; False for what is no number at all."""
    try:
        return not math.isfinite(float(value))
    except OverflowError:
        return True
    except (TypeError, ValueError):
        return False
