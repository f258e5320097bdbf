"""vllm_args -> the flags `vllm serve` gets, each one vLLM knows with a value of the kind it takes.

Flags that settings own or that carry secrets are refused, naming the setting to use instead.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from typing import Any

from gpufleet.errors import shown
from gpufleet.vllm.flags import FlagInfo, known_flags
from gpufleet.vllm.profiles import Profile
from gpufleet.vllm.spec import ArgValue, parse_token_count
from gpufleet.vllm.value_rules import Fail, check_arg_size, not_finite, says_secret

# Whole-number flags and their lower bounds.
_INT_FLAGS = {
    "max-num-batched-tokens": 1,
    "max-num-seqs": 1,
    "pipeline-parallel-size": 1,
    "tensor-parallel-size": 1,
    "optimization-level": 0,
    "mamba-block-size": 1,
    "prefix-match-unit": 1,
    "block-size": 1,
    "data-parallel-size": 1,
    "shutdown-timeout": 0,
}
_JSON_OBJECT_FLAGS = {"override-generation-config", "hf-overrides", "limit-mm-per-prompt"}
# "Should either be a valid JSON string or JSON keys" in --help=all: a mapping is serialised for them.
_JSON_FLAGS = _JSON_OBJECT_FLAGS | {
    "attention-config",
    "aux-output-config",
    "compilation-config",
    "custom-histogram-buckets",
    "default-chat-template-kwargs",
    "default-mm-loras",
    "diffusion-config",
    "ec-manager-config",
    "ec-transfer-config",
    "engram-config",
    "eplb-config",
    "fault-tolerance-config",
    "ir-op-priority",
    "kernel-config",
    "kv-events-config",
    "kv-transfer-config",
    "logging-config",
    "media-io-kwargs",
    "mm-processor-kwargs",
    "model-class-overrides",
    "pooler-config",
    "profiler-config",
    "quantization-config",
    "reasoning-config",
    "speculative-config",
    "structured-outputs-config",
    "watermark-config",
    "weight-transfer-config",
}
_ARGS_OWNED = {"port": "vllm_port", "model": "vllm_model (the directory under vllm_models_dir)"}
# Their settings reach vLLM through the root-only env file.
_SECRET_FLAG_SETTINGS = {"api-key": "vllm_api_key", "hf-token": "vllm_hf_token"}
# Names with a secret word whose values are token counts.
NOT_SECRET_FLAGS = frozenset(
    {"dbo-decode-token-threshold", "dbo-prefill-token-threshold", "long-prefill-token-threshold"}
)


def flag_name(key: str) -> str:
    """Keys "max_model_len" and "--max-model-len" both name max-model-len."""
    return key.lstrip("-").replace("_", "-")


def merge_vllm_args(
    profile: Profile, overrides: Any, subs: dict[str, str], fail: Fail, defaults: Mapping[str, ArgValue]
) -> dict[str, ArgValue]:
    """The profile's flags, then `defaults` (as if the profile had them), then the host's vllm_args over both."""
    merged: dict[str, ArgValue] = {}
    for name, value in {**profile.vllm_args, **defaults}.items():
        merged[name] = value if isinstance(value, bool) else _substitute(str(value), subs)
    if not isinstance(overrides, Mapping):
        fail("vllm_args", f"{shown(overrides)} is not a mapping", 'use e.g. {"max-model-len": 131072}')
        return merged
    flags = known_flags()
    for key, value in overrides.items():
        name = flag_name(str(key))
        setting = f"vllm_args[{key!r}]"
        if name == "model" and value is None:
            fail(
                setting,
                "cannot be removed: the service serves vllm_model through --model",
                "set vllm_model to change the model",
            )
            continue
        if name in _ARGS_OWNED:
            fail(setting, "is managed by a setting", f"set {_ARGS_OWNED[name]} instead")
            continue
        info = flags.get(name)
        if info is not None and info.takes_value and says_secret(name) and name not in NOT_SECRET_FLAGS:
            fix = (
                f"set {_SECRET_FLAG_SETTINGS[name]} instead"
                if name in _SECRET_FLAG_SETTINGS
                else f'pass it as an env var: vllm_secret_env {{"{name.upper().replace("-", "_")}": ...}}'
            )
            fail(setting, f"--{name} carries a secret, which would show in the unit, `ps` and `gpufleet render`", fix)
            continue
        if info is None:
            close = difflib.get_close_matches(name, flags, n=1)
            fail(
                setting,
                f"--{name} is not a vllm serve flag",
                f"did you mean {close[0]}?" if close else "see `vllm serve --help=all`",
            )
            continue
        if value is None:
            merged.pop(name, None)
            continue
        checked = _check_flag_value(setting, info, value, fail)
        if checked is not None:
            merged[name] = checked
    return merged


def _substitute(text: str, subs: Mapping[str, str]) -> str:
    # Not str.format: JSON values contain braces.
    for key, value in subs.items():
        text = text.replace("{" + key + "}", value)
    return text


def _check_flag_value(setting: str, info: FlagInfo, value: Any, fail: Fail) -> ArgValue | None:
    name = info.name
    if not info.takes_value:
        if value is True or (value is False and info.negatable):
            return value
        fail(setting, f"--{name} is a switch, not {shown(value)}", "use True" + (" or False" if info.negatable else ""))
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float, dict)):
        fail(setting, f"--{name} needs a value, not {shown(value)}", "give a string or number")
        return None
    if name in _JSON_FLAGS and (isinstance(value, dict) or name in _JSON_OBJECT_FLAGS):
        text = _json_object(setting, value, fail)
    elif isinstance(value, dict):
        fail(setting, f"--{name} does not take a mapping", "give a string or number")
        return None
    else:
        text = _plain_value(setting, info, value, fail)
    return text if text is not None and check_arg_size(setting, text, fail) else None


def _json_object(setting: str, value: Any, fail: Fail) -> str | None:
    fix = 'give a JSON object, e.g. {"temperature": 0.6}'
    if isinstance(value, dict):
        try:
            return json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            fail(setting, f"is not JSON-serialisable ({type(exc).__name__}: {exc})", fix)
            return None
    text = str(value)

    def no_constants(word: str) -> None:
        raise ValueError(f"{word} is not JSON")

    try:
        parsed = json.loads(text, parse_constant=no_constants)
    except ValueError as exc:
        where = f"{exc.msg} at char {exc.pos}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        fail(setting, f"is not valid JSON ({where})", fix)
        return None
    if not isinstance(parsed, dict):
        fail(setting, "must be a JSON object", fix)
        return None
    return text


def _plain_value(setting: str, info: FlagInfo, value: Any, fail: Fail) -> str | None:
    name = info.name
    text = str(value)
    if (isinstance(value, float) or info.value_type in ("int", "float")) and not_finite(text):
        fail(setting, f"--{name} {text} is not a finite number", "give a finite number")
        return None
    if info.choices and not info.open_choices and text not in info.choices:
        fail(setting, f"{shown(text)} is not a valid choice for --{name}", f"use one of: {', '.join(info.choices)}")
        return None
    if name in _INT_FLAGS:
        if not re.fullmatch(r"-?[0-9]+", text) or int(text) < _INT_FLAGS[name]:
            fail(
                setting, f"--{name} must be an integer >= {_INT_FLAGS[name]}, not {shown(text)}", "give a whole number"
            )
            return None
        if name == "optimization-level" and int(text) > 3:
            fail(setting, f"--optimization-level must be 0-3, not {text}", "use 0, 1, 2 or 3")
            return None
    if name == "max-model-len" and not (parse_token_count(text) or text in ("auto", "-1")):
        fail(setting, f"--max-model-len {shown(text)} is not a token count", 'e.g. 131072 or "128k"')
        return None
    return text


def check_cross_flag_rules(args: Mapping[str, ArgValue], gpus: tuple[int, ...], fail: Fail, nodes: int = 1) -> None:
    """The rules across flags; `nodes` is the hosts of a replica group, each with len(gpus) GPUs."""

    def as_int(name: str, default: int) -> int:
        value = args.get(name)
        return int(value) if isinstance(value, str) and re.fullmatch(r"[0-9]+", value) else default

    if gpus and nodes > 1:
        _check_group_layout(
            as_int("tensor-parallel-size", 1),
            as_int("pipeline-parallel-size", 1),
            as_int("data-parallel-size", 1),
            len(gpus),
            nodes,
            fail,
        )
    elif gpus:
        dp = as_int("data-parallel-size", 1)
        tp, pp = as_int("tensor-parallel-size", 1), as_int("pipeline-parallel-size", 1)
        if dp * tp * pp != len(gpus):
            sizes = (
                f"data-parallel-size {dp} x " if dp != 1 else ""
            ) + f"tensor-parallel-size {tp} x pipeline-parallel-size {pp} = {dp * tp * pp}"
            fit = len(gpus) // (dp * tp)
            fix = f"list {dp * tp * pp} GPUs" + (
                f" or set vllm_args pipeline-parallel-size to {fit}" if fit and fit * dp * tp == len(gpus) else ""
            )
            fail("vllm_gpus", f"{len(gpus)} GPU(s) listed but {sizes}", fix)
    if args.get("enable-auto-tool-choice") is True and not args.get("tool-call-parser"):
        fail(
            "vllm_args['enable-auto-tool-choice']",
            "requires --tool-call-parser",
            'set vllm_args tool-call-parser, e.g. "qwen3_coder"',
        )
    mnbt, seqs = args.get("max-num-batched-tokens"), args.get("max-num-seqs")
    if isinstance(mnbt, str) and isinstance(seqs, str) and mnbt.isdigit() and seqs.isdigit() and int(mnbt) < int(seqs):
        fail(
            "vllm_args['max-num-batched-tokens']",
            f"{mnbt} is below max-num-seqs {seqs}",
            f"set max-num-batched-tokens to at least {seqs}",
        )


def _check_group_layout(tp: int, pp: int, dp: int, per_host: int, nodes: int, fail: Fail) -> None:
    """A replica group's layout: pipeline parallel across the hosts, tensor parallel within each."""
    if dp != 1:
        fail(
            "vllm_args['data-parallel-size']",
            f"{dp}: a replica group is one engine across its hosts",
            "remove it (more replicas: more groups or hosts behind a router)",
        )
    elif tp * pp != per_host * nodes:
        fit = per_host * nodes // tp if tp and per_host * nodes % tp == 0 else 0
        fix = f"set vllm_args pipeline-parallel-size to {fit}" if fit else f"list {tp * pp // nodes} GPUs per host"
        fail(
            "vllm_gpus",
            f"{nodes} hosts x {per_host} GPU(s) but tensor-parallel-size {tp} x pipeline-parallel-size "
            f"{pp} = {tp * pp}",
            fix,
        )
    elif per_host % tp:
        fail(
            "vllm_args['tensor-parallel-size']",
            f"{tp} does not divide the {per_host} GPU(s) of each host: tensor "
            "parallel would span hosts, every layer's all-reduce crossing the network",
            f"set tensor-parallel-size to {per_host} and pipeline-parallel-size to {nodes}",
        )
