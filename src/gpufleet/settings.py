"""Host data -> a validated ServeSpec. Every problem is found before anything touches a host.

Errors are one line each and name the host, the setting and the fix; all of a host's problems are reported at
once (SettingErrors) so users fix them in one go.
"""

from __future__ import annotations

import difflib
import json
import posixpath
import re
from collections.abc import Mapping
from typing import Any

from gpufleet.defaults import DEFAULTS
from gpufleet.errors import SettingError, SettingErrors
from gpufleet.profiles import PROFILES, Profile
from gpufleet.spec import ArgValue, Mount, OptionValue, ServeSpec, parse_token_count
from gpufleet.vllm_flags import known_flags

# Prefixes of our settings: other host data (ssh_*, pyinfra's own keys, users' extras) is not ours to judge.
_OUR_PREFIXES = ("vllm_", "gpufleet_", "docker_", "nvidia_")
_SERVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IMAGE_REF = re.compile(r"^[a-z0-9][a-z0-9._:/-]*(?::[\w][\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")
# Flags whose value must be a whole number (argparse type=int in vLLM) and their lower bounds.
_INT_FLAGS = {"max-num-batched-tokens": 1, "max-num-seqs": 1, "pipeline-parallel-size": 1,
              "tensor-parallel-size": 1, "optimization-level": 0, "mamba-block-size": 1,
              "prefix-match-unit": 1, "block-size": 1, "data-parallel-size": 1}
_JSON_OBJECT_FLAGS = {"override-generation-config", "hf-overrides", "limit-mm-per-prompt"}
# Settings that own a flag or option: naming it in vllm_args/vllm_docker_options would fight the setting.
_ARGS_OWNED = {"port": "vllm_port", "api-key": "vllm_api_key (kept out of the command line)"}
_OPTIONS_OWNED = {"gpus": "vllm_gpus", "publish": "vllm_port", "p": "vllm_port", "env": "vllm_env",
                  "e": "vllm_env", "volume": "vllm_models_dir / vllm_cache_dir", "v": "vllm_models_dir / vllm_cache_dir",
                  "label": "vllm_service", "rm": "(always set)", "name": "vllm_service", "detach": "(never: systemd supervises)",
                  "d": "(never: systemd supervises)"}
_SECRET_ENV = {"VLLM_API_KEY": "vllm_api_key", "HF_TOKEN": "vllm_hf_token", "HUGGING_FACE_HUB_TOKEN": "vllm_hf_token"}


def merged_settings(host_data: Mapping[str, Any]) -> dict[str, Any]:
    """DEFAULTS overlaid with the host's data (pyinfra already merged group_data into it)."""
    return {**DEFAULTS, **{k: v for k, v in host_data.items() if k in DEFAULTS}}


def flag_name(key: str) -> str:
    """vllm_args keys: "max_model_len", "max-model-len" and "--max-model-len" all mean the same flag."""
    return key.lstrip("-").replace("_", "-")


def build_spec(host: str, host_data: Mapping[str, Any]) -> ServeSpec:
    """Validate a host's settings and build its ServeSpec; raise SettingErrors listing every problem."""
    errors: list[SettingError] = []

    def fail(setting: str, problem: str, fix: str) -> None:
        errors.append(SettingError(host, setting, problem, fix))

    _check_unknown_settings(host_data, fail)
    s = merged_settings(host_data)
    profile = PROFILES.get(s["vllm_profile"]) if isinstance(s["vllm_profile"], str) else None
    if profile is None:
        fail("vllm_profile", f"unknown profile {s['vllm_profile']!r}", f"use one of: {', '.join(sorted(PROFILES))}")
        raise SettingErrors(errors)

    image = _check_image(s["vllm_image"], fail)
    gpus = _check_gpus(s["vllm_gpus"], fail)
    port = _check_port(s["vllm_port"], fail)
    service = s["vllm_service"]
    if not isinstance(service, str) or not _SERVICE_NAME.match(service):
        fail("vllm_service", f"{service!r} is not a valid unit/label name", "use letters, digits, '-', '_' and '.'")
    models_dir = _check_abs_dir("vllm_models_dir", s["vllm_models_dir"], fail)
    cache_dir = _check_abs_dir("vllm_cache_dir", s["vllm_cache_dir"], fail)
    model = s["vllm_model"]
    if not isinstance(model, str) or not model or model.startswith("/") or ".." in model.split("/"):
        fail("vllm_model", f"{model!r} is not a directory name under vllm_models_dir", 'set e.g. "qwen3.5-awq"')
    _check_plain_settings(s, fail)

    substitutions = {"model_path": posixpath.join(profile.models_mount, str(model)),
                     "served_model_name": str(model), "port": str(port)}
    vllm_args = _merge_vllm_args(profile, s["vllm_args"], substitutions, fail)
    env = _merge_env(profile, s["vllm_env"], fail)
    options = _merge_docker_options(profile, s["vllm_docker_options"], fail)
    _check_cross_flag_rules(vllm_args, gpus, fail)
    if errors:
        raise SettingErrors(errors)

    mounts = (Mount(models_dir, profile.models_mount),) + tuple(
        Mount(posixpath.join(cache_dir, sub), path) for sub, path in profile.cache_mounts.items()
    )
    return ServeSpec(
        host=host, service=service, image=image, gpus=gpus, port=port,
        docker_options=tuple(options.items()), env=tuple(env.items()),
        secret_env_names=("VLLM_API_KEY",) if s["vllm_api_key"] else (),
        mounts=mounts, vllm_args=tuple(vllm_args.items()), hybrid=profile.hybrid, native_model=profile.native,
    )


# --- single settings ---------------------------------------------------------------------------------------
def _check_unknown_settings(host_data: Mapping[str, Any], fail) -> None:
    for key in host_data:
        if key.startswith(_OUR_PREFIXES) and key not in DEFAULTS:
            close = difflib.get_close_matches(key, DEFAULTS, n=1)
            fail(key, "unknown setting", f"did you mean {close[0]}?" if close else "see the settings table in README.md")


def _check_image(value: Any, fail) -> str:
    if not isinstance(value, str) or not _IMAGE_REF.match(value):
        fail("vllm_image", f"{value!r} is not an image reference", 'use "repo:tag" or "repo@sha256:<digest>"')
        return ""
    return value


def _check_gpus(value: Any, fail) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        fail("vllm_gpus", f"{value!r} is not a non-empty list of GPU indexes", "set e.g. [0, 1, 2]")
        return ()
    if not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in value):
        fail("vllm_gpus", f"{list(value)!r} must hold non-negative integers", "set e.g. [0, 1, 2]")
        return ()
    if len(set(value)) != len(value):
        fail("vllm_gpus", f"{list(value)!r} lists a GPU twice", f"list each GPU once: {sorted(set(value))}")
    return tuple(value)


def _check_port(value: Any, fail) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        fail("vllm_port", f"{value!r} is not a port number", "use an integer from 1 to 65535, e.g. 5000")
        return 0
    return value


def _check_abs_dir(setting: str, value: Any, fail) -> str:
    if not isinstance(value, str) or not value.startswith("/") or ":" in value:
        fail(setting, f"{value!r} is not an absolute path", "use an absolute path without ':' (systemd does not expand ~)")
        return "/"
    return posixpath.normpath(value)


def _check_plain_settings(s: Mapping[str, Any], fail) -> None:
    for secret in ("vllm_hf_token", "vllm_api_key"):
        if s[secret] is not None and (not isinstance(s[secret], str) or not s[secret] or "\n" in s[secret]):
            fail(secret, "must be a one-line string or None", "set the token as a string (value not shown)")
    for key in ("vllm_model_repo", "vllm_model_revision"):
        if s[key] is not None and (not isinstance(s[key], str) or not s[key].strip()):
            fail(key, f"{s[key]!r} must be a string or None", 'e.g. "Qwen/Qwen3.5-27B-FP8"')
    for key in ("vllm_ready_timeout", "vllm_ready_soak_s", "gpufleet_min_free_gb_docker",
                "gpufleet_min_free_gb_models"):
        if not isinstance(s[key], (int, float)) or isinstance(s[key], bool) or s[key] < 0:
            fail(key, f"{s[key]!r} is not a non-negative number", f"e.g. {DEFAULTS[key]}")
    if not isinstance(s["gpufleet_min_cuda"], str) or not re.match(r"^\d+\.\d+$", s["gpufleet_min_cuda"]):
        fail("gpufleet_min_cuda", f"{s['gpufleet_min_cuda']!r} is not a CUDA version", 'use "MAJOR.MINOR", e.g. "13.0"')
    if not isinstance(s["gpufleet_allow_no_gpu"], bool):
        fail("gpufleet_allow_no_gpu", f"{s['gpufleet_allow_no_gpu']!r} is not True/False", "set True or False")
    if s["docker_install"] not in ("docker-ce", "distro"):
        fail("docker_install", f"{s['docker_install']!r} is not an install method", 'use "docker-ce" or "distro"')
    for key in ("docker_repo_url", "nvidia_repo_url"):
        if not isinstance(s[key], str) or not re.match(r"^https?://[^\s]+$", s[key]):
            fail(key, f"{s[key]!r} is not an http(s) URL", f"e.g. {DEFAULTS[key]}")


# --- vLLM flags, env, docker options -----------------------------------------------------------------------
def _merge_vllm_args(profile: Profile, overrides: Any, subs: dict[str, str], fail) -> dict[str, ArgValue]:
    merged: dict[str, ArgValue] = {}
    for name, value in profile.vllm_args.items():
        merged[name] = value if isinstance(value, bool) else _substitute(str(value), subs)
    if not isinstance(overrides, Mapping):
        fail("vllm_args", f"{overrides!r} is not a mapping", 'use e.g. {"max-model-len": 131072}')
        return merged
    flags = known_flags()
    for key, value in overrides.items():
        name = flag_name(str(key))
        setting = f"vllm_args[{key!r}]"
        if name in _ARGS_OWNED:
            fail(setting, "is managed by a setting", f"set {_ARGS_OWNED[name]} instead")
            continue
        info = flags.get(name)
        if info is None:
            close = difflib.get_close_matches(name, flags, n=1)
            fail(setting, f"--{name} is not a vllm serve flag",
                 f"did you mean {close[0]}?" if close else "see `vllm serve --help=all`")
            continue
        if value is None:
            merged.pop(name, None)
            continue
        checked = _check_flag_value(setting, info, value, fail)
        if checked is not None:
            merged[name] = checked
    return merged


def _substitute(text: str, subs: Mapping[str, str]) -> str:
    # Plain replacement, not str.format: values such as the generation-config JSON contain braces.
    for key, value in subs.items():
        text = text.replace("{" + key + "}", value)
    return text


def _check_flag_value(setting: str, info, value: Any, fail) -> ArgValue | None:
    name = info.name
    if not info.takes_value:
        if value is True or (value is False and info.negatable):
            return value
        fail(setting, f"--{name} is a switch, not {value!r}", "use True" + (" or False" if info.negatable else ""))
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float, dict)):
        fail(setting, f"--{name} needs a value, not {value!r}", "give a string or number")
        return None
    if name in _JSON_OBJECT_FLAGS:
        text = json.dumps(value) if isinstance(value, dict) else str(value)
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            fail(setting, f"is not valid JSON ({exc.msg} at char {exc.pos})", 'give a JSON object, e.g. {"temperature": 0.6}')
            return None
        if not isinstance(parsed, dict):
            fail(setting, "must be a JSON object", 'give a JSON object, e.g. {"temperature": 0.6}')
            return None
        return text
    if isinstance(value, dict):
        fail(setting, f"--{name} does not take a mapping", "give a string or number")
        return None
    text = str(value)
    if info.choices and not info.open_choices and text not in info.choices:
        fail(setting, f"{text!r} is not a valid choice for --{name}", f"use one of: {', '.join(info.choices)}")
        return None
    if name in _INT_FLAGS:
        if not re.match(r"^-?\d+$", text) or int(text) < _INT_FLAGS[name]:
            fail(setting, f"--{name} must be an integer >= {_INT_FLAGS[name]}, not {text!r}", "give a whole number")
            return None
        if name == "optimization-level" and int(text) > 3:
            fail(setting, f"--optimization-level must be 0-3, not {text}", "use 0, 1, 2 or 3")
            return None
    if name == "max-model-len" and not (parse_token_count(text) or text in ("auto", "-1")):
        fail(setting, f"--max-model-len {text!r} is not a token count", 'e.g. 131072 or "128k"')
        return None
    return text


def _merge_env(profile: Profile, overrides: Any, fail) -> dict[str, str]:
    merged = dict(profile.env)
    if not isinstance(overrides, Mapping):
        fail("vllm_env", f"{overrides!r} is not a mapping", 'use e.g. {"OMP_NUM_THREADS": "8"}')
        return merged
    for name, value in overrides.items():
        setting = f"vllm_env[{name!r}]"
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            fail(setting, "is not an environment variable name", "use letters, digits and '_'")
        elif name in _SECRET_ENV:
            fail(setting, "is a secret and would land in the unit and `ps`", f"set {_SECRET_ENV[name]} instead")
        elif value is None:
            merged.pop(name, None)
        elif isinstance(value, bool) or not isinstance(value, (str, int, float)) or "\n" in str(value):
            fail(setting, f"{value!r} is not a one-line string or number", 'quote it, e.g. "1"')
        else:
            merged[name] = str(value)
    return merged


def _merge_docker_options(profile: Profile, overrides: Any, fail) -> dict[str, OptionValue]:
    merged: dict[str, OptionValue] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in profile.docker_options.items()
    }
    if not isinstance(overrides, Mapping):
        fail("vllm_docker_options", f"{overrides!r} is not a mapping", 'use e.g. {"privileged": None}')
        return merged
    for key, value in overrides.items():
        name = str(key).lstrip("-")
        setting = f"vllm_docker_options[{key!r}]"
        if name in _OPTIONS_OWNED:
            fail(setting, "is managed by gpufleet", f"use {_OPTIONS_OWNED[name]}")
        elif value is None:
            merged.pop(name, None)
        elif value is True or (isinstance(value, str) and value):
            merged[name] = value
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
            merged[name] = tuple(value)
        else:
            fail(setting, f"{value!r} is not True, a string or a list of strings", 'e.g. {"shm-size": "16g"}')
    return merged


def _check_cross_flag_rules(args: Mapping[str, ArgValue], gpus: tuple[int, ...], fail) -> None:
    def as_int(name: str, default: int) -> int:
        value = args.get(name)
        return int(value) if isinstance(value, str) and re.match(r"^\d+$", value) else default

    if gpus:
        tp, pp = as_int("tensor-parallel-size", 1), as_int("pipeline-parallel-size", 1)
        if tp * pp != len(gpus):
            fail("vllm_gpus", f"{len(gpus)} GPU(s) listed but tensor-parallel-size {tp} x pipeline-parallel-size "
                 f"{pp} = {tp * pp}", f"list {tp * pp} GPUs or set vllm_args pipeline-parallel-size to {len(gpus) // tp or 1}")
    if args.get("enable-auto-tool-choice") is True and not args.get("tool-call-parser"):
        fail("vllm_args['enable-auto-tool-choice']", "requires --tool-call-parser",
             'set vllm_args tool-call-parser, e.g. "qwen3_coder"')
    mnbt, seqs = args.get("max-num-batched-tokens"), args.get("max-num-seqs")
    if isinstance(mnbt, str) and isinstance(seqs, str) and mnbt.isdigit() and seqs.isdigit() and int(mnbt) < int(seqs):
        fail("vllm_args['max-num-batched-tokens']", f"{mnbt} is below max-num-seqs {seqs}",
             f"set max-num-batched-tokens to at least {seqs}")
