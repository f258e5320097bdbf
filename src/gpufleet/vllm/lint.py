"""The config doctor: known vLLM traps in a host's spec, each rule plain data (id, severity, message, fix).

Add a rule by appending a LintRule to RULES; `applies` reads only the spec, the settings and what a running server
reported, so rules stay offline. How to read a report: docs/lint.md; the facts behind each rule: docs/vllm-traps.md.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar, overload

from gpufleet.defaults import ACCEPT_SETTING
from gpufleet.errors import SettingError, shown
from gpufleet.vllm.profiles._profile import JIT_CACHES, JIT_REDIRECTS
from gpufleet.vllm.spec import ArgValue, OptionValue, ServeSpec
from gpufleet.wire.geometry import PREFERRED_UNIT, legal_prefix_match_unit, resolved_block_sizes

# What --shutdown-timeout the fix proposes: long enough for a typical coding-agent turn to finish streaming.
SHUTDOWN_TIMEOUT_S = 60
# NVIDIA's control nodes that a GPU container needs besides one /dev/nvidia<N> per GPU.
NVIDIA_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
_ALL_INTERFACES = ("0.0.0.0", "::", "")
# vllm-router policies that send a conversation's turns to one replica, whose prefix cache then holds its prompt.
PREFIX_KEEPING_POLICIES = ("cache_aware", "sticky_least_loaded", "consistent_hash")

Severity = Literal["error", "warning", "info"]
# Most severe first; what each means for the exit status: docs/lint.md.
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "info")


@dataclass(frozen=True)
class LintContext:
    spec: ServeSpec
    settings: Mapping[str, Any]  # merged settings (secrets are only tested for presence)
    served: Mapping[str, str] = field(default_factory=dict)  # the server's vllm:cache_config_info labels, if known

    def arg(self, name: str) -> ArgValue | None:
        return self.spec.arg(name)

    @overload
    def int_arg(self, name: str) -> int | None: ...
    @overload
    def int_arg(self, name: str, default: int) -> int: ...

    def int_arg(self, name: str, default: int | None = None) -> int | None:
        value = self.spec.arg(name)
        return int(value) if isinstance(value, str) and value.isdigit() else default

    @property
    def env(self) -> dict[str, str]:
        return dict(self.spec.env)

    @property
    def options(self) -> dict[str, OptionValue]:
        return dict(self.spec.docker_options)

    @property
    def align(self) -> bool:
        return self.spec.hybrid and self.spec.prefix_caching and self.spec.mamba_cache_mode == "align"

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """The block sizes the running server resolved, else a --block-size pinned in the settings."""
        served = resolved_block_sizes(self.served)
        pinned = self.int_arg("block-size")
        return served or ((pinned,) if pinned else ())


@dataclass(frozen=True)
class RouterLintContext:
    policy: str  # the router host's router_policy, validated
    replicas: int  # how many vLLM hosts the router routes to


@dataclass(frozen=True)
class AcceptContext:
    rule_id: str  # one entry of a host's gpufleet_accept


# What a rule reads: a vLLM host's LintContext, a router's RouterLintContext, one gpufleet_accept entry.
C = TypeVar("C")


@dataclass(frozen=True)
class LintRule(Generic[C]):
    id: str
    severity: Severity  # see SEVERITIES
    message: str  # what is wrong and why it matters
    fix: str | Callable[[C], str]  # the setting to change (a function when the value depends on the host)
    applies: Callable[[C], bool]

    def fix_for(self, context: C) -> str:
        return self.fix(context) if callable(self.fix) else self.fix


@dataclass(frozen=True)
class Finding:
    host: str
    rule: LintRule[Any]
    fix: str  # the rule's fix for this host

    @property
    def severity(self) -> Severity:
        return self.rule.severity

    def __str__(self) -> str:
        return f"{self.host}: {self.rule.severity} [{self.rule.id}] {self.rule.message} (fix: {self.fix})"


# Rules that need more than one line


def _align_without_safe_chunking(c: LintContext) -> bool:
    if not c.align or c.arg("prefix-match-unit"):
        return False
    blocks = c.block_sizes
    # The attention block size of a hybrid in align mode is chosen at start-up (~528-2048 tokens on GPUs):
    # unless the token budget equals the block, chunks can end off a block boundary.
    return len(blocks) != 1 or c.int_arg("max-num-batched-tokens") != blocks[0]


def _legal_unit_fix(c: LintContext) -> str:
    unit = legal_prefix_match_unit(c.block_sizes)
    then = "then check with `gpufleet verify INVENTORY --probe`"
    if unit:
        blocks = "/".join(map(str, c.block_sizes))
        return f'set vllm_args = {{"prefix-match-unit": {unit}}} (divides the block size {blocks}), {then}'
    return (
        "set vllm_args prefix-match-unit to a divisor of the block size `gpufleet status` shows for this host "
        f"({PREFERRED_UNIT} when it divides it; vLLM refuses to start otherwise; `gpufleet verify --probe` prints "
        f"the exact value), {then}"
    )


def _illegal_unit(c: LintContext) -> bool:
    unit = c.int_arg("prefix-match-unit")
    return bool(unit and c.block_sizes and any(b % unit for b in c.block_sizes))


def _gpu_device_nodes(c: LintContext) -> list[str]:
    return [*NVIDIA_CONTROL_NODES, *(f"/dev/nvidia{g}" for g in c.spec.gpus)]


def _explicit_device_fix(c: LintContext, drop_privileged: bool) -> str:
    nodes = ", ".join(f'"{n}"' for n in _gpu_device_nodes(c))
    privileged = '"privileged": None, ' if drop_privileged else ""
    return (
        f'vllm_docker_options = {{{privileged}"device": [{nodes}]}} (the nodes of the GPUs in vllm_gpus, so a '
        "`systemctl daemon-reload` cannot take them away; /dev/nvidia<N> is the GPU's minor number: check with "
        "`nvidia-smi -q | grep Minor`)"
    )


def _gpu_nodes_unlisted(c: LintContext) -> bool:
    if "privileged" in c.options or not c.spec.gpus:
        return False
    device = c.options.get("device", ())
    # A bare `--device` (True) names no node.
    listed = (device,) if isinstance(device, str) else device if isinstance(device, tuple) else ()
    if any(item.startswith("nvidia.com/gpu=") for item in listed):
        return False  # CDI devices carry their nodes in the container's config
    return not set(_gpu_device_nodes(c)) <= {item.split(":")[0] for item in listed}


def _bridge_network(c: LintContext) -> bool:
    network = c.options.get("network", c.options.get("net"))
    return network not in ("host",)


def _host_unreachable_behind_publish(c: LintContext) -> bool:
    host = c.arg("host")
    return isinstance(host, str) and host not in _ALL_INTERFACES and _bridge_network(c)


def _block_above_batch(c: LintContext) -> bool:
    mnbt = c.int_arg("max-num-batched-tokens")
    return c.align and mnbt is not None and any(b > mnbt for b in c.block_sizes)


def _batch_for_block_fix(c: LintContext) -> str:
    example = f'{{"max-num-batched-tokens": {max(c.block_sizes)}}}'
    return f"set vllm_args max-num-batched-tokens to a multiple of the block size, e.g. vllm_args = {example}"


def _unmounted_jit_caches(c: LintContext) -> list[str]:
    """The JIT_CACHES variables whose cache lands in the container's own layer (lost with it), not in a mount."""
    mounted = [m.container_path.rstrip("/") for m in c.spec.mounts]
    out = []
    for name, where, default in JIT_CACHES:
        path = where.format(c.env.get(name) or default)
        if not any(path == m or path.startswith(m + "/") for m in mounted):
            out.append(name)
    return out


def _jit_cache_fix(c: LintContext) -> str:
    values = ", ".join(f'"{name}": "{JIT_REDIRECTS[name]}"' for name in _unmounted_jit_caches(c))
    return (
        f"set vllm_env = {{{values}}} (inside the /root/.cache/vllm mount: kept across restarts, carried by "
        "`gpufleet rollout`)"
    )


def _group_setting_unset(c: LintContext, setting: str) -> bool:
    return c.spec.group is not None and c.settings.get(setting) is None


def _is_qwen35(c: LintContext) -> bool:
    model = f"{c.settings.get('vllm_model', '')} {c.arg('model') or ''}".lower()
    # Every Qwen 3.5 profile is named qwen35 or qwen35-<variant>.
    return str(c.settings.get("vllm_profile", "")).startswith("qwen35") or "qwen3.5" in model or "qwen3_5" in model


RULES: tuple[LintRule[LintContext], ...] = (
    LintRule(
        "privileged-exposes-all-gpus",
        "warning",
        "--privileged makes every GPU visible in the container, whatever --gpus device=... lists",
        lambda c: "drop it and list the GPUs' device nodes: " + _explicit_device_fix(c, drop_privileged=True),
        lambda c: "privileged" in c.options,
    ),
    LintRule(
        "gpus-lost-on-daemon-reload",
        "error",
        "without --privileged, GPUs injected by --gpus vanish from the running container on the next "
        "`systemctl daemon-reload` (the deploy runs one) under the systemd cgroup driver: 'Failed to initialize "
        "NVML: Unknown Error'",
        lambda c: _explicit_device_fix(c, drop_privileged=False),
        _gpu_nodes_unlisted,
    ),
    LintRule(
        "mamba-block-size-ignored",
        "warning",
        "--mamba-block-size is ignored when --mamba-cache-mode is align (vLLM sets it to the attention block size), "
        "and explicit sizes have crashed hybrids upstream (#57266, #53142)",
        'remove it: vllm_args = {"mamba-block-size": None}',
        lambda c: c.arg("mamba-block-size") is not None and c.spec.mamba_cache_mode == "align",
    ),
    LintRule(
        "flashinfer-moe-fp16-deprecated",
        "info",
        "VLLM_USE_FLASHINFER_MOE_FP16 is deprecated (removed in newer vLLM; logs 'Unknown vLLM environment variable')",
        'remove it: vllm_env = {"VLLM_USE_FLASHINFER_MOE_FP16": None}',
        lambda c: "VLLM_USE_FLASHINFER_MOE_FP16" in c.env,
    ),
    LintRule(
        "pytorch-alloc-conf-alone",
        "warning",
        "PYTORCH_ALLOC_CONF alone is ignored by some torch versions (2.9.1); vLLM reads PYTORCH_CUDA_ALLOC_CONF",
        "also set vllm_env PYTORCH_CUDA_ALLOC_CONF to the same value",
        lambda c: "PYTORCH_ALLOC_CONF" in c.env and "PYTORCH_CUDA_ALLOC_CONF" not in c.env,
    ),
    LintRule(
        "open-without-api-key",
        "warning",
        "--host 0.0.0.0 with the port published on every interface, and no API key is set",
        "set vllm_api_key (kept in a root-only file), or keep the API off the network with "
        'vllm_publish_address = "127.0.0.1" (keep --host 0.0.0.0: vLLM bound to 127.0.0.1 inside the container '
        "answers nothing on the published port)",
        lambda c: (
            c.arg("host") in _ALL_INTERFACES
            and c.spec.publish_address is None
            and not c.settings.get("vllm_api_key")
            and not (c.spec.group and c.spec.group.rank)
        ),  # a rank serves none
    ),
    LintRule(
        "host-unreachable-behind-published-port",
        "error",
        "vLLM's --host is not 0.0.0.0 under bridge networking: docker forwards the published port to the "
        "container's own interface, where nothing listens, and the deploy waits its full vllm_ready_timeout",
        'set vllm_args = {"host": "0.0.0.0"} (and vllm_api_key)',
        _host_unreachable_behind_publish,
    ),
    LintRule(
        "trust-remote-code-unneeded",
        "info",
        "--trust-remote-code runs the model repo's Python code, but this architecture is supported by vLLM itself",
        'remove it: vllm_args = {"trust-remote-code": None}',
        lambda c: c.arg("trust-remote-code") is True and c.spec.native_model,
    ),
    LintRule(
        "max-num-seqs-below-pipeline-depth",
        "info",
        "max-num-seqs is below pipeline-parallel-size: some pipeline stages sit idle",
        "set vllm_args max-num-seqs to at least pipeline-parallel-size",
        lambda c: c.int_arg("max-num-seqs", 1024) < c.int_arg("pipeline-parallel-size", 1),
    ),
    LintRule(
        "qwen35-pipeline-parallel-4-or-more",
        "error",
        "Qwen 3.5 with --pipeline-parallel-size 4 or more fails at runtime upstream (vLLM issues #36643, #37972)",
        'use at most 3 pipeline stages, e.g. for 4 GPUs vllm_args = {"tensor-parallel-size": 2, "pipeline-parallel-size": 2}',
        lambda c: _is_qwen35(c) and (c.int_arg("pipeline-parallel-size", 1) or 1) >= 4,
    ),
    LintRule(
        "no-shutdown-timeout",
        "warning",
        "without --shutdown-timeout vLLM aborts every in-flight request on SIGTERM: each deploy restart or "
        "rollout cuts off the answers being streamed",
        f'set vllm_args = {{"shutdown-timeout": {SHUTDOWN_TIMEOUT_S}}} (the unit\'s stop timeouts follow it and '
        "stay above it: docker stop --time and TimeoutStopSec)",
        lambda c: c.int_arg("shutdown-timeout", 0) == 0,
    ),
    LintRule(
        "hybrid-prefix-caching-without-chunked-prefill",
        "error",
        "--mamba-cache-mode align needs chunked prefill: vLLM refuses to start without it ('Chunked prefill is "
        "required for mamba cache mode 'align'')",
        'set vllm_args = {"enable-chunked-prefill": True}',
        lambda c: c.align and c.arg("enable-chunked-prefill") is False,
    ),
    LintRule(
        "align-block-above-batch",
        "error",
        "in align mode the block size is larger than --max-num-batched-tokens: vLLM versions with the check "
        "(PR #34445) refuse to start; `gpufleet verify` shows the log line",
        _batch_for_block_fix,
        _block_above_batch,
    ),
    LintRule(
        "prefix-match-unit-not-dividing-block",
        "error",
        "--prefix-match-unit does not divide the block size the server resolved: vLLM refuses to start",
        _legal_unit_fix,
        _illegal_unit,
    ),
    LintRule(
        "jit-cache-outside-mounts",
        "warning",
        "a JIT cache the image writes (Triton's ~/.triton/cache, FlashInfer's ~/.cache/flashinfer) is in the "
        "container's own layer: every container start compiles those kernels again, and the rollout cannot carry them",
        _jit_cache_fix,
        lambda c: bool(_unmounted_jit_caches(c)),
    ),
    LintRule(
        "hybrid-align-chunk-alignment",
        "warning",
        "on a hybrid in align mode, prompt chunks that end off a block boundary silently lose whole prefix "
        "hits (measured: docs/vllm-traps.md)",
        _legal_unit_fix,
        _align_without_safe_chunking,
    ),
    LintRule(
        "group-interface-unset",
        "warning",
        "no interface is set for the replica group's traffic: Gloo and NCCL pick one themselves (docker0, a second "
        "NIC, the management network), and the ranks fail to meet or send every activation over the wrong link",
        'set vllm_group_interface to the NIC of the group\'s network on this host (`ip -br addr`), e.g. "enp65s0"',
        lambda c: _group_setting_unset(c, "vllm_group_interface"),
    ),
    LintRule(
        "group-link-unstated",
        "warning",
        "pipeline parallel across hosts sends every token's activations between them, and no link is stated: over "
        "1 GbE every request waits on the network",
        'state the link, e.g. vllm_group_link = "25GbE" (10 GbE or faster), or serve a replica per box behind a router',
        lambda c: _group_setting_unset(c, "vllm_group_link"),
    ),
)


def lint_spec(
    spec: ServeSpec,
    settings: Mapping[str, Any],
    rules: tuple[LintRule[LintContext], ...] = RULES,
    served: Mapping[str, str] | None = None,
) -> list[Finding]:
    """Findings for one host. served: the host's vllm:cache_config_info labels (HealthReport.cache_config), when
    the server runs: fixes that depend on the resolved block size then name exact values."""
    context = LintContext(spec, settings, served or {})
    return [Finding(spec.host, rule, rule.fix_for(context)) for rule in rules if rule.applies(context)]


ROUTER_RULES: tuple[LintRule[RouterLintContext], ...] = (
    LintRule(
        "router-policy-ignores-prefix-cache",
        "warning",
        "router_policy spreads a conversation's turns over the replicas: with N of them, (N-1)/N of the turns land "
        "on a replica that has not cached the conversation's prefix and re-process the whole prompt",
        'set router_policy = "cache_aware" (or "consistent_hash" with a session header such as X-Session-ID)',
        lambda c: c.replicas > 1 and c.policy not in PREFIX_KEEPING_POLICIES,
    ),
)


def lint_router(
    host: str,
    *,
    policy: str,
    replicas: int,
    rules: tuple[LintRule[RouterLintContext], ...] = ROUTER_RULES,
) -> list[Finding]:
    """Findings for one router host, whose settings are valid (resolve_router); replicas: how many vLLM hosts it
    routes to."""
    context = RouterLintContext(policy, replicas)
    return [Finding(host, rule, rule.fix_for(context)) for rule in rules if rule.applies(context)]


@dataclass(frozen=True)
class GroupLintContext:
    """A replica group's ranks as preflight read them (rank order): each one's GPU model and driver version."""

    group: str
    gpus: Mapping[str, str]  # host -> its GPUs' model ("" when it has none)
    drivers: Mapping[str, str]  # host -> its NVIDIA driver version ("" when unknown)

    def differing(self, seen: Mapping[str, str]) -> list[str]:
        """The ranks whose value is not the head's (the first)."""
        head = next(iter(seen.values()), "")
        return [host for host, value in seen.items() if value != head]


def _mixed_fix(c: GroupLintContext, seen: Mapping[str, str], what: str) -> str:
    listed = ", ".join(f"{host} {value or 'unknown'}" for host, value in seen.items())
    return f"serve the group on hosts with the same {what} ({listed})"


GROUP_RULES: tuple[LintRule[GroupLintContext], ...] = (
    LintRule(
        "group-mixed-gpu-models",
        "error",
        "the replica group's ranks have different GPU models: vLLM sizes every pipeline stage's KV cache to the "
        "smallest rank's memory and runs at the slowest rank's pace; the deploy refuses it",
        lambda c: (
            _mixed_fix(c, c.gpus, "GPU model") + ", or accept it on purpose: gpufleet_accept = "
            '["group-mixed-gpu-models"] on the head'
        ),
        lambda c: bool(c.differing(c.gpus)),
    ),
    LintRule(
        "group-mixed-drivers",
        "error",
        "the replica group's ranks run different NVIDIA drivers: NCCL between them may fail to initialise or "
        "hang; the deploy refuses it",
        lambda c: (
            _mixed_fix(c, c.drivers, "driver") + ", or accept it on purpose: gpufleet_accept = "
            '["group-mixed-drivers"] on the head'
        ),
        lambda c: bool(c.differing(c.drivers)),
    ),
)


def lint_group(
    head: str, context: GroupLintContext, rules: tuple[LintRule[GroupLintContext], ...] = GROUP_RULES
) -> list[Finding]:
    """Findings for a replica group over what its ranks reported (gpufleet.vllm.deploy's preflight reads them)."""
    return [Finding(head, rule, rule.fix_for(context)) for rule in rules if rule.applies(context)]


# What a host accepts on purpose


def acceptable_rule_ids() -> tuple[str, ...]:
    """The ids gpufleet_accept may name: every rule over a host's settings (not the accept rules themselves)."""
    return (*(rule.id for rule in RULES), *(rule.id for rule in ROUTER_RULES), *(rule.id for rule in GROUP_RULES))


def _unknown_accept_fix(c: AcceptContext) -> str:
    known = acceptable_rule_ids()
    close = difflib.get_close_matches(c.rule_id, known, n=1)
    if close:
        return f"{shown(c.rule_id)}: did you mean {close[0]!r}?"
    return f"{shown(c.rule_id)} is none of the rule ids: {', '.join(known)}"


ACCEPT_RULES: tuple[LintRule[AcceptContext], ...] = (
    LintRule(
        "unknown-accepted-rule",
        # A typo accepts nothing, so the finding it meant still shows and counts: nothing is hidden by it.
        "warning",
        "gpufleet_accept names no lint rule, so it accepts nothing",
        _unknown_accept_fix,
        lambda c: c.rule_id not in acceptable_rule_ids(),
    ),
)
# Every rule lint has, whatever it reads.
ALL_RULES: tuple[LintRule[Any], ...] = (*RULES, *ROUTER_RULES, *GROUP_RULES, *ACCEPT_RULES)


def accepted_rule_ids(host: str, value: Any) -> frozenset[str]:
    """A host's gpufleet_accept as a set of rule ids; raises SettingError when it is no list of strings (a bare
    string included: "no-shutdown-timeout" would otherwise read as its letters)."""
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(item, str) for item in value):
        return frozenset(value)
    raise SettingError(
        host,
        ACCEPT_SETTING,
        f"{shown(value)} is not a list of lint rule ids",
        f'e.g. {ACCEPT_SETTING} = ["open-without-api-key"], with a comment saying why',
    )


def lint_accept(
    host: str, accepted: Collection[str], rules: tuple[LintRule[AcceptContext], ...] = ACCEPT_RULES
) -> list[Finding]:
    """Findings about a host's gpufleet_accept entries themselves (an id that names no rule)."""
    return [
        Finding(host, rule, rule.fix_for(context))
        for context in map(AcceptContext, sorted(accepted))
        for rule in rules
        if rule.applies(context)
    ]
