"""Host data -> validated VllmSettings and ServeSpec: every problem of a host at once, one line each, before
anything touches it. What is refused and why: docs/hardening.md.
"""

from __future__ import annotations

import difflib
import posixpath
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gpufleet.defaults import (
    DEFAULTS,
    EXPECT_COMMITTED_SETTING,
    GPU_CLEARED_SETTING,
    GPU_VERDICTS_SETTING,
    IMAGE_REF_SETTING,
    LEASE_SETTING,
    MODEL_SHA_SETTING,
    REFRESH_KEYS_SETTING,
    RENAMED_SETTINGS,
    RETRY_SETTING,
    SPEED_BASELINE_SETTING,
    SPEED_BATCHES_SETTING,
    SPEED_TOLERANCE_SETTING,
    STAGE_SETTING,
    STAGES,
    VERIFY_CHECKS_SETTING,
    VERIFY_PROBE_SETTING,
    WAIT_SETTING,
    Stage,
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
from gpufleet.wire.gpu_verdicts import GpuSettings, Verdict, cleared_at, verdict_table
from gpufleet.wire.speed import SpeedFigures

# Other host data (ssh_*, pyinfra's own keys, users' extras) is not ours to judge.
_OUR_PREFIXES = ("vllm_", "gpufleet_", "docker_", "nvidia_")
# systemd refuses unit file lines longer than LONG_LINE_MAX (1 MiB); keep room for the pinned digest.
MAX_UNIT_LINE_BYTES = 1024 * 1024 - 4096
# Settings that change what one run does; a rollout passes them as `--data key=value`.
RUN_FLAGS = (RETRY_SETTING, VERIFY_PROBE_SETTING, REFRESH_KEYS_SETTING, SPEED_BATCHES_SETTING)
_BOOL_WORDS = {"true": True, "false": False}
_FIELD_PREFIXES = ("vllm_", "gpufleet_")


def field_name(setting: str) -> str:
    """The VllmSettings field of a setting: "vllm_cache_dir" -> "cache_dir", "site_cache_port" stays."""
    for prefix in _FIELD_PREFIXES:
        if setting.startswith(prefix):
            return setting.removeprefix(prefix)
    return setting


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmSettings(Mapping[str, Any]):
    """A vLLM host's settings once validated: one field per key of DEFAULTS (README.md's settings table).

    Also a read-only mapping by setting name, for the modules that still read keys (issue 41); read fields.
    """

    # The vLLM service
    profile: str
    image: str
    gpus: tuple[int, ...]
    port: int
    publish_address: str | None
    model: str
    model_repo: str | None
    model_revision: str | None
    hf_endpoint: str
    models_dir: str
    cache_dir: str
    args: Mapping[str, object]  # the host's overrides; the spec holds the merged flags, env and options
    env: Mapping[str, object]
    docker_options: Mapping[str, object]
    service: str
    hf_token: str | None
    api_key: str | None
    secret_env: Mapping[str, str]
    ready_timeout: float
    ready_soak_s: float
    # A replica group
    group: str | None
    group_port: int
    group_address: str | None
    group_interface: str | None
    group_link: str | None
    fetch_timeout_s: float
    # Host preflight, GPU health, the host lock
    min_cuda: str
    min_free_gb_docker: float
    min_free_gb_models: float
    allow_no_gpu: bool
    gpu_verdicts: Mapping[str, str]
    gpu_cleared_at: str | None
    lock_wait_s: float
    lock_lease_s: float
    # What one run does
    image_ref: str | None  # the pinned digest reference
    model_sha: str | None
    stage: Stage
    retry_failed: bool
    expect_committed: Mapping[str, str | None] | None
    verify_probe: bool
    verify_checks: tuple[str, ...]
    speed_tolerance: float
    speed_baseline: Mapping[str, SpeedFigures] | None
    speed_batches: bool
    refresh_keys: bool
    accept: tuple[str, ...]  # its string entries: lint reports the others
    # Docker engine, NVIDIA toolkit, site cache
    docker_install: str
    docker_repo_url: str
    nvidia_repo_url: str
    site_cache_port: int
    site_cache_internal_port: int
    site_cache_clients: tuple[str, ...]
    site_cache_max_gb: float
    site_cache_upstream: str
    site_cache_address: str
    site_cache_mirror_port: int
    site_cache_model_max_gb: float
    site_cache_mirror_index_url: str
    site_cache_pull_timeout_s: float

    @property
    def gpu_settings(self) -> GpuSettings:
        return GpuSettings(verdict_table(self.gpu_verdicts), cleared_at(self.gpu_cleared_at))

    def __getitem__(self, setting: str) -> Any:
        if setting not in DEFAULTS:
            raise KeyError(setting)
        return getattr(self, field_name(setting))

    def __iter__(self) -> Iterator[str]:
        return iter(DEFAULTS)

    def __len__(self) -> int:
        return len(DEFAULTS)


def _frozen(value: Any) -> Any:
    """A setting's value with its dicts and lists made read-only (MappingProxyType, tuple)."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    return value


def _settings_record(s: Mapping[str, Any]) -> VllmSettings:
    """The record of merged settings that passed every check, parsed where a check parsed them."""
    accept = s["gpufleet_accept"]
    return VllmSettings(
        profile=s["vllm_profile"],
        image=s["vllm_image"],
        gpus=tuple(s["vllm_gpus"]),
        port=s["vllm_port"],
        publish_address=s["vllm_publish_address"],
        model=s["vllm_model"],
        model_repo=s["vllm_model_repo"],
        model_revision=s["vllm_model_revision"],
        hf_endpoint=s["vllm_hf_endpoint"],
        models_dir=s["vllm_models_dir"],
        cache_dir=s["vllm_cache_dir"],
        args=_frozen(s["vllm_args"]),
        env=_frozen(s["vllm_env"]),
        docker_options=_frozen(s["vllm_docker_options"]),
        service=s["vllm_service"],
        hf_token=s["vllm_hf_token"],
        api_key=s["vllm_api_key"],
        secret_env=_frozen(s["vllm_secret_env"]),
        ready_timeout=s["vllm_ready_timeout"],
        ready_soak_s=s["vllm_ready_soak_s"],
        group=s["vllm_group"],
        group_port=s["vllm_group_port"],
        group_address=s["vllm_group_address"],
        group_interface=s["vllm_group_interface"],
        group_link=s["vllm_group_link"],
        fetch_timeout_s=s["vllm_fetch_timeout_s"],
        min_cuda=s["gpufleet_min_cuda"],
        min_free_gb_docker=s["gpufleet_min_free_gb_docker"],
        min_free_gb_models=s["gpufleet_min_free_gb_models"],
        allow_no_gpu=s["gpufleet_allow_no_gpu"],
        gpu_verdicts=_frozen(s[GPU_VERDICTS_SETTING]),
        gpu_cleared_at=s[GPU_CLEARED_SETTING],
        lock_wait_s=s[WAIT_SETTING],
        lock_lease_s=s[LEASE_SETTING],
        image_ref=s[IMAGE_REF_SETTING],
        model_sha=s[MODEL_SHA_SETTING],
        stage=s[STAGE_SETTING],
        retry_failed=s[RETRY_SETTING],
        expect_committed=_frozen(s[EXPECT_COMMITTED_SETTING]),
        verify_probe=s[VERIFY_PROBE_SETTING],
        verify_checks=s[VERIFY_CHECKS_SETTING],
        speed_tolerance=s[SPEED_TOLERANCE_SETTING],
        speed_baseline=_frozen(s[SPEED_BASELINE_SETTING]),
        speed_batches=s[SPEED_BATCHES_SETTING],
        refresh_keys=s[REFRESH_KEYS_SETTING],
        accept=tuple(a for a in accept if isinstance(a, str)) if isinstance(accept, (list, tuple)) else (),
        docker_install=s["docker_install"],
        docker_repo_url=s["docker_repo_url"],
        nvidia_repo_url=s["nvidia_repo_url"],
        site_cache_port=s["site_cache_port"],
        site_cache_internal_port=s["site_cache_internal_port"],
        site_cache_clients=tuple(s["site_cache_clients"]),
        site_cache_max_gb=s["site_cache_max_gb"],
        site_cache_upstream=s["site_cache_upstream"],
        site_cache_address=s["site_cache_address"],
        site_cache_mirror_port=s["site_cache_mirror_port"],
        site_cache_model_max_gb=s["site_cache_model_max_gb"],
        site_cache_mirror_index_url=s["site_cache_mirror_index_url"],
        site_cache_pull_timeout_s=s["site_cache_pull_timeout_s"],
    )


def merged_settings(host_data: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting's value for a host, not validated: its data over its profile's defaults over DEFAULTS.

    >>> merged_settings({"vllm_profile": "qwen35-1gpu"})["vllm_service"]
    'vllm-qwen35-1gpu'
    """
    # An old name stands in for its new one; the new one wins where both are set.
    ours = {new: host_data[old] for old, new in RENAMED_SETTINGS.items() if old in host_data}
    ours.update((k, v) for k, v in host_data.items() if k in DEFAULTS)
    profile = profile_for(ours.get("vllm_profile", DEFAULTS["vllm_profile"]))
    return {**DEFAULTS, **(profile.settings if profile else {}), **ours}


def renamed_settings(host: str, host_data: Mapping[str, Any]) -> list[str]:
    """A warning line per old setting name the host data still uses."""
    return [
        f"{host}: {old} is deprecated (fix: rename it {new}; it means the same)"
        for old, new in RENAMED_SETTINGS.items()
        if old in host_data
    ]


def profile_for(name: Any) -> Profile | None:
    """The profile a vllm_profile value names, None when it names none."""
    return PROFILES.get(name) if isinstance(name, str) else None


# The flag a router's cache_aware policy needs on its replicas (docs/router.md says what it opens, and why).
BEHIND_ROUTER_ARGS: dict[str, ArgValue] = {"enable-scale-out": True}


def build_spec(
    host: str, host_data: Mapping[str, Any], *, behind_router: bool = False, member: Member | None = None
) -> ServeSpec:
    """Validate a host's settings and build its ServeSpec; raise SettingErrors listing every problem."""
    return resolve_host(host, host_data, behind_router=behind_router, member=member)[0]


def resolve_host(
    host: str, host_data: Mapping[str, Any], *, behind_router: bool = False, member: Member | None = None
) -> tuple[ServeSpec, VllmSettings]:
    """build_spec, and the settings it was built from."""
    errors: list[SettingError] = []
    # A problem is named as the host data spells the setting, old name or new.
    spelled = {new: old for old, new in RENAMED_SETTINGS.items() if old in host_data and new not in host_data}

    def fail(setting: str, problem: str, fix: str) -> None:
        errors.append(SettingError(host, spelled.get(setting, setting), problem, fix))

    _check_unknown_settings(host_data, fail)
    # Control characters first, and alone: every later check would quote the value into its message.
    _check_control_characters(host, host_data, fail)
    if errors:
        raise SettingErrors(errors)
    s = merged_settings(host_data)
    profile = profile_for(s["vllm_profile"])
    if profile is None:
        fail(
            "vllm_profile", f"unknown profile {shown(s['vllm_profile'])}", f"use one of: {', '.join(sorted(PROFILES))}"
        )
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
        fail(
            VERIFY_CHECKS_SETTING,
            f"{shown(s[VERIFY_CHECKS_SETTING])}: {error}",
            f'list some of {", ".join(SERVING_CHECKS)}, or "all" or "none"',
        )
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

    substitutions = {
        "model_path": posixpath.join(profile.models_mount, str(model)),
        "served_model_name": str(model),
        "port": str(port),
    }
    vllm_args = merge_vllm_args(
        profile, s["vllm_args"], substitutions, fail, BEHIND_ROUTER_ARGS if behind_router else {}
    )
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
        host=host,
        service=service,
        image=image,
        gpus=gpus,
        port=port,
        docker_options=tuple(options.items()),
        env=tuple(env.items()),
        secret_env_names=(("VLLM_API_KEY",) if s["vllm_api_key"] else ()) + secret_names,
        mounts=mounts,
        vllm_args=tuple(vllm_args.items()),
        hybrid=profile.hybrid,
        native_model=profile.native,
        publish_address=publish_address,
        group=member,
    )
    _check_unit_line(spec, fail)
    if errors:
        raise SettingErrors(errors)
    return spec, _settings_record(s)


# --- before the merge: what the host data holds -----------------------------------------------------------
def _check_unknown_settings(host_data: Mapping[str, Any], fail: Fail) -> None:
    for key in host_data:
        if key in RENAMED_SETTINGS:
            if RENAMED_SETTINGS[key] in host_data:
                fail(key, f"is the old name of {RENAMED_SETTINGS[key]}, which is set too", f"drop {key}")
        elif isinstance(key, str) and key.startswith(_OUR_PREFIXES) and key not in DEFAULTS:
            close = difflib.get_close_matches(key, DEFAULTS, n=1)
            fail(
                key, "unknown setting", f"did you mean {close[0]}?" if close else "see the settings table in README.md"
            )


def _check_control_characters(host: str, host_data: Mapping[str, Any], fail: Fail) -> None:
    if not isinstance(host, str) or control_character(host):
        fail(
            "inventory host name",
            f"holds a control character ({control_character(str(host))}), which would "
            "break the unit's header and every log line",
            "rename the host in the inventory",
        )
    for key, value in host_data.items():
        if key in DEFAULTS or key in RENAMED_SETTINGS:
            for setting, text in _strings(key, value):
                found = control_character(text)
                if found:
                    # The value is not echoed: it may be a secret.
                    fail(
                        setting,
                        f"holds a control character ({found}), which would end a line of the systemd unit",
                        "remove it: only printable characters are allowed",
                    )


def _strings(setting: str, value: Any) -> Iterator[tuple[str, str]]:
    """(setting path, text) for every string in a setting's value, keys included."""
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
    for key in RUN_FLAGS:
        if not isinstance(s[key], bool):
            fail(key, f"{shown(s[key])} is not true/false", f"set True or False, or pass --data {key}=true")
    if s[STAGE_SETTING] not in STAGES:
        fail(STAGE_SETTING, f"{shown(s[STAGE_SETTING])} is not a stage", f"use one of: {', '.join(STAGES)}")


def _check_speed_settings(s: dict[str, Any], fail: Fail) -> None:
    """The speed check's tolerance, and the baseline a rollout passes, parsed."""
    tolerance = s[SPEED_TOLERANCE_SETTING]
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not 0 < tolerance < 1:
        fail(
            SPEED_TOLERANCE_SETTING,
            f"{shown(tolerance)} is not a fraction between 0 and 1",
            f"e.g. {DEFAULTS[SPEED_TOLERANCE_SETTING]} (a figure may lose 70% of its speed)",
        )
    baseline = s[SPEED_BASELINE_SETTING]
    if baseline is None:
        return
    try:
        if not isinstance(baseline, dict) or not all(isinstance(k, str) for k in baseline):
            raise ValueError("not a map of host name to figures")
        s[SPEED_BASELINE_SETTING] = {host: SpeedFigures.from_dict(doc) for host, doc in baseline.items()}
    except ValueError as error:
        fail(
            SPEED_BASELINE_SETTING,
            f"{shown(baseline)}: {error}",
            "leave it unset: a rollout passes it, measured on each host before its swap",
        )


def _check_gpu_settings(s: Mapping[str, Any], fail: Fail) -> None:
    try:
        verdict_table(s[GPU_VERDICTS_SETTING])
    except ValueError as error:
        fail(
            GPU_VERDICTS_SETTING,
            str(error),
            f'map signals of the table in docs/gpu-health.md to one of {", ".join(Verdict)}, e.g. {{"xid 43": "ok"}}',
        )
    try:
        cleared_at(s[GPU_CLEARED_SETTING])
    except ValueError as error:
        fail(
            GPU_CLEARED_SETTING,
            f"{shown(s[GPU_CLEARED_SETTING])} {error}",
            'give an ISO 8601 time with its zone, e.g. "2026-12-03T10:00:00Z", or None',
        )


def _check_unit_line(spec: ServeSpec, fail: Fail) -> None:
    size = len(systemd_exec(spec.docker_run_argv(docker=DOCKER)).encode())
    if size > MAX_UNIT_LINE_BYTES:
        fail(
            "vllm_args / vllm_env / vllm_docker_options",
            f"the docker run line is {size} bytes, over the {MAX_UNIT_LINE_BYTES} bytes a systemd unit line can hold",
            "shorten the longest values",
        )
