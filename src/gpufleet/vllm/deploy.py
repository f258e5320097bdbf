"""From a bare GPU host to a verified vLLM service running Qwen 3.5, idempotently.

    pyinfra inventories/lab.py deploys/qwen35.py           # converge every host
    pyinfra inventories/lab.py deploys/qwen35.py --dry     # show what would change
    pyinfra inventories/lab.py deploys/qwen35.py --limit gpu2

    pyinfra inventories/lab.py deploys/qwen35.py --limit gpu2 --data gpufleet_stage=prepare   # pull, no restart

The playbook only: gpufleet.harness.preflight reads and checks every host first (one SSH command each, in
parallel) and refuses the whole run, before any operation executes, when any host fails a check (a corrupt ledger,
a version that failed before included); gpufleet.vllm.verify is the verify step's callback. The host's ledger
(gpufleet.hoststate.ledger) is settled first when a cut run left a pending version. Hosts in the `routers` group are
skipped (deploys/router.py configures them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pyinfra import host
from pyinfra.api import Host, deploy
from pyinfra.context import ctx_state

from gpufleet.defaults import (
    EXPECT_COMMITTED_SETTING,
    IMAGE_REF_SETTING,
    REFRESH_KEYS_SETTING,
    RETRY_SETTING,
    STAGE_SETTING,
    VERIFY_CHECKS_SETTING,
    VERIFY_PROBE_SETTING,
)
from gpufleet.harness import preflight
from gpufleet.hoststate.ledger import (
    CorruptLedger,
    DropPending,
    FinishPending,
    Nothing,
    Observed,
    Resume,
    RollBackPending,
    Version,
    corrupt_refusal,
    drop_pending,
    refused_target,
    resume,
)  # fmt: skip
from gpufleet.hoststate.rules import changed_since_read, cut_rename_away, host_ledger, replaced_service
from gpufleet.inventory import ROUTERS_GROUP, behind_router
from gpufleet.operations import files
from gpufleet.operations.base import not_for_this_host
from gpufleet.operations.run import remember
from gpufleet.operations.secret import Hidden
from gpufleet.sitecache import deploy as site_cache
from gpufleet.sitecache.operations import STORAGE as SITE_CACHE_STORAGE
from gpufleet.vllm import checks, group_deploy
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.host_command import Paths
from gpufleet.vllm.host_read import HOST_READ
from gpufleet.vllm.layout import Layout
from gpufleet.vllm.group_verify import GroupVerification
from gpufleet.vllm.operations import docker, flagcheck, group, image, managed_paths, model, nvidia, service
from gpufleet.vllm.operations.image import pinned_ref
from gpufleet.vllm.spec import ServeSpec
from gpufleet.vllm.verify import Verification, verify_passed
from gpufleet.wire.checks import verify_checks


@dataclass(frozen=True)
class Plan:
    """One host's deploy, decided before anything runs: its spec, its settings (merged once), where things live,
    and what the snapshot reads."""

    spec: ServeSpec
    settings: Mapping[str, Any]
    layout: Layout
    paths: Paths


def plan_for(name: str, data: dict[str, Any]) -> Plan:
    """Host data -> Plan (raises SettingErrors, one line per bad setting)."""
    # A router in front (the run's inventory has one) adds its flags, as for every offline view of the inventory.
    # (A State made without an inventory, as pyinfra's inventory loader makes one, has no attribute for it.)
    inventory = getattr(ctx_state.get(), "inventory", None) if ctx_state.isset() else None
    fronted = inventory is not None and behind_router(inventory)
    spec, s = group_deploy.resolve(name, data, inventory, fronted)  # a replica group's ranks resolved together
    if inventory is not None:
        site_cache.check_port(inventory, name, s, spec.port)
    serves_cache = inventory is not None and site_cache.serves_site(inventory.get_host(name))
    layout = Layout.of(spec, s["vllm_cache_dir"])
    managed = managed_paths(layout)
    paths = Paths(
        service=spec.service, models_dir=layout.models_dir, model_dir=layout.model_dir, dirs=managed.dirs,
        # The ledger's checksum too: its writes are compare-and-swap on what this run read (under the lock).
        files=(*managed.files, layout.ledger_path), ledger_path=layout.ledger_path, env_file=layout.env_file, port=spec.port,
        nvidia_key_url=nvidia.key_url(s["nvidia_repo_url"]), nvidia_version_file=nvidia.VERSION_FILE,
        docker_repo_url=s["docker_repo_url"].rstrip("/") if s["docker_install"] == "docker-ce" else None,
        nvidia_keyring=nvidia.KEYRING, docker_keyring=docker.DOCKER_KEY, refresh_keys=bool(s[REFRESH_KEYS_SETTING]),
        address=spec.reach_address, site_cache_storage=SITE_CACHE_STORAGE if serves_cache else None,
        group_head=group_deploy.probe_target(spec),
    )
    return Plan(spec, s, layout, paths)


def is_vllm_host(target: Host) -> bool:
    """Not a router host (those run vllm-router in front of the vLLM hosts: deploys/router.py configures them)."""
    return ROUTERS_GROUP not in target.groups


def observed(snap: HostSnapshot, plan: Plan) -> Observed:
    running = snap.running
    return Observed(unit_sha256=snap.file_sha256.get(plan.layout.unit_file), running_ref=running.running_image,
                    running_spec_hash=running.running_spec_hash, active=running.active_state == "active",
                    restarts=running.restarts)


def check_host(name: str, snap: HostSnapshot, plan: Plan) -> list[str]:
    s, spec = plan.settings, plan.spec
    try:
        ledger = host_ledger(snap.ledger_text, snap.other_ledgers, spec.port)
    except CorruptLedger as error:
        # The deploy must not guess which digest runs: refused before anything changes, the file left as it is.
        return [corrupt_refusal(name, plan.layout.ledger_path, error)]
    ref = pinned_ref(ledger, spec.image, s[IMAGE_REF_SETTING])
    problems = checks.check(name, snap, s, spec.gpus, ref)
    cut = cut_rename_away(name, snap.other_ledgers, spec.service)
    if cut:
        problems.append(cut)
    unreachable = group_deploy.probe_problem(name, snap, spec)
    if unreachable:
        problems.append(unreachable)
    # The ledger the service goes by, as the rollout read it (gpufleet.rollout.ledgers applies the same rules).
    changed = changed_since_read(name, ledger, s[EXPECT_COMMITTED_SETTING])
    if changed:
        problems.append(changed)
    if ref and not s[RETRY_SETTING]:
        target = Version(image=spec.image, ref=ref, unit_sha256=None, spec_hash=spec.spec_hash, service=spec.service,
                         port=spec.port)
        refused = refused_target(ledger, target)
        if refused:
            problems.append(f"{name}: {refused}")
    return problems


def settle_and_pin(plan: Plan, snap: HostSnapshot, prepare: bool) -> tuple[Resume, str | None]:
    """What a cut run's pending record asks first, and the digest this run installs when known before the pull. A
    dropped change never reached the unit: its digest is not this run's pin (a finished one's is)."""
    ledger = host_ledger(snap.ledger_text, snap.other_ledgers, plan.spec.port)  # preflight refused a corrupt one
    decision = Nothing("prepare") if prepare else resume(ledger, observed(snap, plan))
    return decision, pinned_ref(drop_pending(ledger) if isinstance(decision, DropPending) else ledger,
                                plan.spec.image, plan.settings[IMAGE_REF_SETTING])


@deploy("Deploy Qwen 3.5 on vLLM")
def deploy_qwen35() -> None:
    if not is_vllm_host(host):
        not_for_this_host(name="Skip the vLLM deploy on a router host",
                          why="router host: deploys/router.py configures it")
        return
    plan, snap = preflight.preflight(plan_for, check_host, HOST_READ, applies=is_vllm_host,
                                     check_fleet=group_deploy.check_groups)
    s, spec, layout = plan.settings, plan.spec, plan.layout
    held = remember(host, snap)  # every operation decides from this one read
    has_gpu = bool(snap.gpus)
    ledger = host_ledger(snap.ledger_text, snap.other_ledgers, spec.port)  # preflight refused a corrupt one
    prepare = s[STAGE_SETTING] == "prepare"
    # A cut run's pending version is settled first: dropped, or rolled back (then nothing else runs), or finished
    # below. A prepare run changes no ledger and restarts nothing: it leaves that to the converge.
    decision, pin = settle_and_pin(plan, snap, prepare)
    held.ledger = ledger
    held.ledger_sha256[plan.layout.ledger_path] = snap.file_sha256.get(plan.layout.ledger_path)
    # A replica group's ranks: one digest, restarted, verified and committed or rolled back together.
    readings = preflight.fleet_readings(plan_for) if spec.group else {}
    ranks = group_deploy.group_for(host, spec, readings, lambda r: settle_and_pin(r.plan, r.snapshot, prepare)[1]
                                   if r.plan is not None and r.snapshot is not None else None)
    if ranks is not None:
        decision, pin = group_deploy.as_group(decision), ranks.pin
    retry_failed = bool(s[RETRY_SETTING])

    api_key = s["vllm_api_key"]
    served = [model_id for model_id, _ in snap.served_models or []] if snap.health_code == "200" else []
    verify = (Verification if ranks is None else GroupVerification)(
        spec, float(s["vllm_ready_timeout"]), Hidden(api_key) if api_key else None, layout.ledger_path,
        served[0] if served else spec.served_model_name,
        checks=verify_checks(s[VERIFY_CHECKS_SETTING], bool(s[VERIFY_PROBE_SETTING])),
        **({} if ranks is None else {"group": ranks}))
    if not isinstance(decision, Nothing):
        service.settled(name="Settle the change a cut run left pending", decision=decision,
                        ledger_path=layout.ledger_path, roll_back=verify.roll_back_cut)
        if isinstance(decision, RollBackPending):
            return

    files.prerequisites(name="Install apt prerequisites (ca-certificates, curl)")
    refresh_keys = bool(s[REFRESH_KEYS_SETTING])
    docker.engine(name="Install the Docker engine", install=s["docker_install"], repo_url=s["docker_repo_url"],
                  refresh_keys=refresh_keys)
    nvidia.toolkit_repo(name="Add the NVIDIA container toolkit apt repository", repo_url=s["nvidia_repo_url"],
                      refresh_keys=refresh_keys)
    nvidia.toolkit(name="Install the NVIDIA container toolkit")
    runtime = nvidia.docker_runtime(name="Register the nvidia runtime with Docker")
    nvidia.version_file(name="Record the NVIDIA driver's CUDA version")
    docker.running(name="Start the Docker engine")
    docker.restarted(name="Restart Docker to load its new configuration", _if=runtime.did_change)

    files.directories(name="Create the vLLM, torch and ComputeCache cache directories",
                      paths=list(service.managed(layout).dirs), mode="755")
    files.directories(name="Create the models and model download cache directories",
                      paths=list(model.managed(layout).dirs), mode="755")
    secrets = service.env_file(name="Write the service's root-only secrets file", path=layout.env_file,
                               secrets=service.hidden_secrets(s))
    # Before the pull, on every host: the site cache runs (its host) and is trusted (every host pulling through it).
    if site_cache.serves_site(host):
        site_cache.deploy_site_cache(host, s, spec.image, snap.site_cache_used_kib)
    cache = site_cache.cache_pull(host, s, spec.image)
    docker.trusts_site_cache(name="Let Docker pull from the site cache, and from no other (insecure-registries)",
                             address=cache.address if cache is not None else None)
    pinned = image.pinned(name="Pull the vLLM image and pin its digest", image=spec.image, ref=pin,
                          service=spec.service, cache=cache)
    if ranks is not None:
        group.same_digest(name="Check every rank of the group pulled one digest", group=ranks)
    if has_gpu:  # without a GPU the service is never started: no version to protect from a rejected flag
        committed_ref = ledger.committed.version.ref if ledger.committed else None
        flagcheck.accepts_flags(name="Check the image accepts the serve flags", spec=spec, committed_ref=committed_ref,
                                pin=pin)
    model.present(name="Download the model unless it is complete", spec=spec, where=layout.model_dir,
                  repo=s["vllm_model_repo"], revision=s["vllm_model_revision"],
                  env_file=layout.env_file if s["vllm_hf_token"] else None, hf_cache=layout.hf_cache, pin=pin)
    if prepare:
        return  # gpufleet_stage=prepare: everything slow is done, the old version keeps serving
    unit = service.unit(name="Install the vLLM systemd unit", spec=spec, path=layout.unit_file,
                        ledger_path=layout.ledger_path, pin=pin, retry_failed=retry_failed)
    changes = [unit, secrets, pinned, runtime]
    finish = isinstance(decision, FinishPending)
    # A pending version that already runs (the cut came after its restart) is verified, not restarted again.
    restart_pending = isinstance(decision, FinishPending) and decision.restart
    if ranks is not None:
        ranks.join(host.name, changes, group_deploy.restart_reasons(snap, spec, decision))
    service.running(name="Enable and start the vLLM service", spec=spec, ledger_path=layout.ledger_path,
                    changes=changes, pin=pin, retry_failed=retry_failed, start=has_gpu, force=restart_pending,
                    replaces=replaced_service(ledger, spec.service), group=ranks)
    # After a (re)start: ready, then still ready for vllm_ready_soak_s. Its verdict picks one of the two operations
    # after it while executing (_if); --dry lists both as conditional changes of a host that will be verified.
    verified = service.ready(name="Verify vLLM is ready (/health, /v1/models), else roll back", spec=spec,
                             verify=verify.verify, roll_back=verify.roll_back_if_failed, changes=changes,
                             start=has_gpu, soak_s=float(s["vllm_ready_soak_s"]), force=finish, group=ranks,
                             serves=group_deploy.head_serves(readings, spec) if ranks is not None else None)
    service.committed(name="Commit the verified vLLM version", verified=verified, commit=verify.commit,
                      _if=verify_passed)
