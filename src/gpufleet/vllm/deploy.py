"""The vLLM deploy: from a bare GPU host to a verified vLLM service, idempotently (docs/deploy.md).

pyinfra inventories/lab.py deploys/qwen35.py [--dry] [--limit gpu2] [--data gpufleet_stage=prepare]
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pyinfra import host, logger
from pyinfra.api import Host, deploy
from pyinfra.context import ctx_state

from gpufleet.facts.gpu_verdict import HostGpus, judge
from gpufleet.harness import preflight
from gpufleet.hostlock import LockTimings
from gpufleet.hoststate.ledger import (
    CorruptLedger,
    DropPending,
    FinishPending,
    Ledger,
    Nothing,
    Observed,
    Resume,
    RollBackPending,
    Version,
    corrupt_refusal,
    drop_pending,
    model_pin,
    refused_target,
    resume,
)  # fmt: skip
from gpufleet.hoststate.rules import changed_since_read, cut_rename_away, host_ledger, replaced_service
from gpufleet.inventory import ROUTERS_GROUP, behind_router
from gpufleet.operations import files
from gpufleet.operations.base import not_for_this_host
from gpufleet.operations.files import sha256
from gpufleet.operations.run import remember
from gpufleet.operations.secret import Hidden
from gpufleet.sitecache import deploy as site_cache
from gpufleet.sitecache.operations import STORAGE as SITE_CACHE_STORAGE
from gpufleet.units import unit_name
from gpufleet.vllm import checks, group_deploy
from gpufleet.vllm.commit import record_gpu
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.group_verify import GroupVerification
from gpufleet.vllm.host_command import Paths
from gpufleet.vllm.host_read import HOST_READ
from gpufleet.vllm.layout import Layout
from gpufleet.vllm.operations import docker, flagcheck, group, image, managed_paths, model, nvidia, service
from gpufleet.vllm.operations.image import image_present, pinned_ref
from gpufleet.vllm.settings import VllmSettings, merged_settings, renamed_settings
from gpufleet.vllm.spec import ServeSpec
from gpufleet.vllm.unit import render_unit
from gpufleet.vllm.verify import Verification, verify_passed
from gpufleet.vllm.weights import MODEL_SHA, ModelTarget
from gpufleet.wire.checks import verify_checks
from gpufleet.wire.gpu_verdicts import Verdict


@dataclass(frozen=True)
class Plan:
    """One host's deploy, decided before anything runs."""

    spec: ServeSpec
    settings: VllmSettings
    layout: Layout
    paths: Paths

    @property
    def lock(self) -> LockTimings:
        return LockTimings(self.settings.lock_wait_s, self.settings.lock_lease_s)


def plan_for(name: str, data: dict[str, Any]) -> Plan:
    """Host data -> Plan; raises SettingErrors."""
    # pyinfra's inventory loader makes a State without an inventory attribute.
    inventory = getattr(ctx_state.get(), "inventory", None) if ctx_state.isset() else None
    fronted = inventory is not None and behind_router(inventory)
    spec, s = group_deploy.resolve(name, data, inventory, fronted)
    if inventory is not None:
        site_cache.check_port(inventory, name, s, spec.port)
    serves_cache = inventory is not None and site_cache.serves_site(inventory.get_host(name))
    layout = Layout.of(spec, s.cache_dir)
    managed = managed_paths(layout)
    paths = Paths(
        service=spec.service,
        models_dir=layout.models_dir,
        model_dir=layout.model_dir,
        dirs=managed.dirs,
        # The ledger's checksum too: its writes compare and swap on it.
        files=(*managed.files, layout.ledger_path),
        ledger_path=layout.ledger_path,
        env_file=layout.env_file,
        port=spec.port,
        nvidia_key_url=nvidia.key_url(s.nvidia_repo_url),
        nvidia_version_file=nvidia.VERSION_FILE,
        docker_repo_url=s.docker_repo_url.rstrip("/") if s.docker_install == "docker-ce" else None,
        nvidia_keyring=nvidia.KEYRING,
        docker_keyring=docker.DOCKER_KEY,
        refresh_keys=s.refresh_keys,
        address=spec.reach_address,
        site_cache_storage=SITE_CACHE_STORAGE if serves_cache else None,
        group_head=group_deploy.probe_target(spec),
    )
    return Plan(spec, s, layout, paths)


def is_vllm_host(target: Host) -> bool:
    """Not a router host (deploys/router.py configures those)."""
    return ROUTERS_GROUP not in target.groups


def observed(snap: HostSnapshot, plan: Plan) -> Observed:
    running = snap.running
    return Observed(
        unit_sha256=snap.file_sha256.get(plan.layout.unit_file),
        running_ref=running.running_image,
        running_spec_hash=running.running_spec_hash,
        active=running.active_state == "active",
        restarts=running.restarts,
    )


def check_host(name: str, snap: HostSnapshot, plan: Plan) -> list[str]:
    s, spec = plan.settings, plan.spec
    try:
        ledger = host_ledger(snap.ledger_text, snap.other_ledgers, spec.port)
    except CorruptLedger as error:
        # Never guess which digest runs: refused, the file left as it is.
        return [corrupt_refusal(name, plan.layout.ledger_path, error)]
    ref = pinned_ref(ledger, spec.image, s.image_ref)
    problems = checks.check(name, snap, s, spec.gpus, ref)
    if snap.gpu_health is not None:
        gpus = judge(snap.gpu_health, s.gpu_settings)
        problems += checks.gpu_refusals(name, gpus, spec.gpus, restart_reason(snap, plan, ledger, ref))
    cut = cut_rename_away(name, snap.other_ledgers, spec.service)
    if cut:
        problems.append(cut)
    unreachable = group_deploy.probe_problem(name, snap, spec)
    if unreachable:
        problems.append(unreachable)
    # As the rollout read it (gpufleet.rollout.ledgers applies the same rules).
    changed = changed_since_read(name, ledger, s.expect_committed)
    if changed:
        problems.append(changed)
    if ref and not s.retry_failed:
        models = model_target(ledger, s)
        target = Version(
            image=spec.image,
            ref=ref,
            unit_sha256=None,
            spec_hash=spec.spec_hash,
            service=spec.service,
            port=spec.port,
            model=models.pin if models else None,
        )
        refused = refused_target(ledger, target)
        if refused:
            problems.append(f"{name}: {refused}")
    return problems


def settle_and_pin(plan: Plan, snap: HostSnapshot, prepare: bool) -> tuple[Resume, str | None, ModelTarget | None]:
    """What a cut run's pending record asks first, and the digest and model this run installs when known before
    it. A dropped change's pins are not this run's."""
    ledger = host_ledger(snap.ledger_text, snap.other_ledgers, plan.spec.port)  # preflight refused a corrupt one
    decision = Nothing("prepare") if prepare else resume(ledger, observed(snap, plan))
    settled = drop_pending(ledger) if isinstance(decision, DropPending) else ledger
    return (
        decision,
        pinned_ref(settled, plan.spec.image, plan.settings.image_ref),
        model_target(settled, plan.settings),
    )


def mirrored_models(target: Host, s: VllmSettings) -> list[str]:
    """The model repos the site cache on `target` mirrors: those of the inventory's hosts on its hub."""
    found = set()
    for other in target.inventory:
        theirs = merged_settings(other.data.dict())  # every host's, whatever --limit plans
        if (
            ROUTERS_GROUP not in other.groups
            and theirs["vllm_model_repo"]
            and theirs["vllm_hf_endpoint"] == s.hf_endpoint
            and not theirs["site_cache_address"]
        ):
            found.add(str(theirs["vllm_model_repo"]))
    return sorted(found)


def model_target(ledger: Ledger, s: VllmSettings) -> ModelTarget | None:
    """The model this run installs (None: staged by hand), with its commit when known before the run."""
    repo, revision = s.model_repo, s.model_revision
    if not repo:
        return None
    if s.model_sha:
        return ModelTarget(repo, revision, f"{repo}@{s.model_sha}")
    if revision and MODEL_SHA.fullmatch(revision):
        return ModelTarget(repo, revision, f"{repo}@{revision}")
    return ModelTarget(repo, revision, model_pin(ledger, repo, revision))


def restart_reason(snap: HostSnapshot, plan: Plan, ledger: Ledger, pin: str | None) -> str | None:
    """What this converge would (re)start and why, as service.running decides it; a tag not resolved yet counts."""
    s, spec, layout, running = plan.settings, plan.spec, plan.layout, snap.running
    unit = unit_name(spec.service)
    model = model_target(ledger, s)
    if s.stage == "prepare" or not snap.gpus:
        return None
    if not snap.unit_active(unit):
        return f"start {unit} (it is not running)"
    why = (
        "a cut run left a version pending"
        if ledger.pending is not None
        else "its image is still to be pulled"
        if pin is None or not image_present(snap.images, pin)
        else "its unit changes"
        if snap.file_sha256.get(layout.unit_file) != sha256(render_unit(spec, pin, model.pin if model else None))
        else "its secrets file changes"
        if snap.file_sha256.get(layout.env_file) != sha256(service.env_content(service.secret_values(s)))
        else "Docker restarts to load the nvidia runtime"
        if not snap.nvidia_runtime
        else "it does not run what its unit says"
        if running.drift()
        else None
    )
    return f"restart {unit} ({why})" if why else None


def planned_restart(reading: preflight.Reading[Plan, HostSnapshot]) -> str | None:
    """restart_reason() of a host as preflight read it."""
    plan, snap = reading.plan, reading.snapshot
    assert plan is not None and snap is not None
    ledger = host_ledger(snap.ledger_text, snap.other_ledgers, plan.spec.port)
    return restart_reason(snap, plan, ledger, pinned_ref(ledger, plan.spec.image, plan.settings.image_ref))


def gpu_refusals(name: str, reading: preflight.Reading[Plan, HostSnapshot], restart: str) -> list[str]:
    plan, snap = reading.plan, reading.snapshot
    assert plan is not None and snap is not None
    if snap.gpu_health is None:
        return []
    return checks.gpu_refusals(name, judge(snap.gpu_health, plan.settings.gpu_settings), plan.spec.gpus, restart)


def check_fleet(readings: Mapping[str, preflight.Reading[Plan, HostSnapshot]]) -> dict[str, list[str]]:
    """The refusals across each replica group's ranks, the GPU gate included."""
    found = group_deploy.check_groups(readings)
    for name, lines in group_deploy.restart_refusals(readings, planned_restart, gpu_refusals).items():
        found.setdefault(name, []).extend(lines)
    return found


def gpu_warnings(gpus: HostGpus, used: tuple[int, ...]) -> list[str]:
    """A line per GPU with a finding that does not stop this run."""
    return [
        f"{g.line()} ({'the service runs on it' if g in gpus.concern(used) else 'the service does not use it'})"
        for g in gpus.gpus
        if g.verdict is not Verdict.OK
    ]


@deploy("Deploy Qwen 3.5 on vLLM")
def deploy_qwen35() -> None:
    if not is_vllm_host(host):
        not_for_this_host(
            name="Skip the vLLM deploy on a router host", why="router host: deploys/router.py configures it"
        )
        return
    plan, snap = preflight.preflight(plan_for, check_host, HOST_READ, applies=is_vllm_host, check_fleet=check_fleet)
    s, spec, layout = plan.settings, plan.spec, plan.layout
    for line in renamed_settings(host.name, host.data.dict()):
        host.log_styled(line, fg="yellow", log_func=logger.warning)
    held = remember(host, snap)  # every operation decides from this read
    if snap.gpu_health is not None:
        # For the ledger entry; the restart settles an app-restart Xid before it.
        gpus = judge(snap.gpu_health, s.gpu_settings, app_started_at=time.time())
        record_gpu(host, gpus.summary(spec.gpus))
        for line in gpu_warnings(gpus, spec.gpus):
            host.log_styled(line, fg="yellow")
    has_gpu = bool(snap.gpus)
    ledger = host_ledger(snap.ledger_text, snap.other_ledgers, spec.port)  # preflight refused a corrupt one
    prepare = s.stage == "prepare"
    # A prepare run changes no ledger and restarts nothing.
    decision, pin, models = settle_and_pin(plan, snap, prepare)
    held.ledger = ledger
    held.ledger_sha256[plan.layout.ledger_path] = snap.file_sha256.get(plan.layout.ledger_path)
    # A replica group's ranks install one version together.
    readings = preflight.fleet_readings(plan_for) if spec.group else {}
    ranks = group_deploy.group_for(
        host,
        spec,
        readings,
        lambda r: (
            settle_and_pin(r.plan, r.snapshot, prepare)[1:]
            if r.plan is not None and r.snapshot is not None
            else (None, None)
        ),
    )
    if ranks is not None:
        decision, pin, models = group_deploy.as_group(decision), ranks.pin, ranks.model
    retry_failed = s.retry_failed

    api_key = s.api_key
    served = [model_id for model_id, _ in snap.served_models or []] if snap.health_code == "200" else []
    verify = (Verification if ranks is None else GroupVerification)(
        spec,
        float(s.ready_timeout),
        Hidden(api_key) if api_key else None,
        layout.ledger_path,
        served[0] if served else spec.served_model_name,
        checks=verify_checks(s.verify_checks, s.verify_probe),
        speed_earlier=(s.speed_baseline or {}).get(spec.host),
        speed_tolerance=float(s.speed_tolerance),
        **({} if ranks is None else {"group": ranks}),
    )
    if not isinstance(decision, Nothing):
        service.settled(
            name="Settle the change a cut run left pending",
            decision=decision,
            ledger_path=layout.ledger_path,
            roll_back=verify.roll_back_cut,
        )
        if isinstance(decision, RollBackPending):
            return

    files.prerequisites(name="Install apt prerequisites (ca-certificates, curl)")
    refresh_keys = s.refresh_keys
    docker.engine(
        name="Install the Docker engine",
        install=s.docker_install,
        repo_url=s.docker_repo_url,
        refresh_keys=refresh_keys,
    )
    nvidia.toolkit_repo(
        name="Add the NVIDIA container toolkit apt repository", repo_url=s.nvidia_repo_url, refresh_keys=refresh_keys
    )
    nvidia.toolkit(name="Install the NVIDIA container toolkit")
    runtime = nvidia.docker_runtime(name="Register the nvidia runtime with Docker")
    nvidia.version_file(name="Record the NVIDIA driver's CUDA version")
    docker.running(name="Start the Docker engine")
    docker.restarted(name="Restart Docker to load its new configuration", _if=runtime.did_change)

    files.directories(
        name="Create the vLLM, torch and ComputeCache cache directories",
        paths=list(service.managed(layout).dirs),
        mode="755",
    )
    files.directories(
        name="Create the models and model download cache directories",
        paths=list(model.managed(layout).dirs),
        mode="755",
    )
    secrets = service.env_file(
        name="Write the service's root-only secrets file", path=layout.env_file, secrets=service.hidden_secrets(s)
    )
    # Before the pull: the cache must run and be trusted.
    if site_cache.serves_site(host):
        site_cache.deploy_site_cache(host, s, spec.image, snap.site_cache_used_kib, models=mirrored_models(host, s))
    cache = site_cache.cache_pull(host, s, spec.image)
    docker.trusts_site_cache(
        name="Let Docker pull from the site cache, and from no other (insecure-registries)",
        address=cache.address if cache is not None else None,
    )
    fetch_s = float(s.fetch_timeout_s)
    pinned = image.pinned(
        name="Pull the vLLM image and pin its digest",
        image=spec.image,
        ref=pin,
        service=spec.service,
        cache=cache,
        timeout_s=fetch_s,
    )
    if has_gpu:  # without one nothing starts: no version to protect
        committed_ref = ledger.committed.version.ref if ledger.committed else None
        flagcheck.accepts_flags(
            name="Check the image accepts the serve flags", spec=spec, committed_ref=committed_ref, pin=pin
        )
    model.present(
        name="Download the model's commit unless it is here and checked",
        spec=spec,
        where=layout.model_dir,
        model=models,
        env_file=layout.env_file if s.hf_token else None,
        hf_cache=layout.hf_cache,
        pin=pin,
        hub=s.hf_endpoint,
        mirror=site_cache.model_mirror(host, s),
        timeout_s=fetch_s,
    )
    if ranks is not None:
        group.same_version(name="Check every rank of the group has one digest and one model commit", group=ranks)
    if prepare:
        return  # the old version keeps serving
    unit = service.unit(
        name="Install the vLLM systemd unit",
        spec=spec,
        path=layout.unit_file,
        ledger_path=layout.ledger_path,
        pin=pin,
        retry_failed=retry_failed,
        model=models,
    )
    changes = [unit, secrets, pinned, runtime]
    finish = isinstance(decision, FinishPending)
    # A pending version that already runs is verified, not restarted again.
    restart_pending = isinstance(decision, FinishPending) and decision.restart
    if ranks is not None:
        ranks.join(host.name, changes, group_deploy.restart_reasons(snap, spec, decision))
    service.running(
        name="Enable and start the vLLM service",
        spec=spec,
        ledger_path=layout.ledger_path,
        changes=changes,
        pin=pin,
        retry_failed=retry_failed,
        start=has_gpu,
        force=restart_pending,
        replaces=replaced_service(ledger, spec.service),
        model=models,
        group=ranks,
    )
    # Its verdict picks the commit or the rollback while executing; --dry lists both.
    verified = service.ready(
        name="Verify vLLM is ready (/health, /v1/models), else roll back",
        spec=spec,
        verify=verify.verify,
        roll_back=verify.roll_back_if_failed,
        changes=changes,
        start=has_gpu,
        soak_s=float(s.ready_soak_s),
        force=finish,
        group=ranks,
        serves=group_deploy.head_serves(readings, spec) if ranks is not None else None,
    )
    service.committed(
        name="Commit the verified vLLM version", verified=verified, commit=verify.commit, _if=verify_passed
    )
