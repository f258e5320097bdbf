"""From a bare GPU host to a verified vLLM service running Qwen 3.5, idempotently.

    pyinfra inventories/lab.py deploys/qwen35.py           # converge every host
    pyinfra inventories/lab.py deploys/qwen35.py --dry     # show what would change
    pyinfra inventories/lab.py deploys/qwen35.py --limit gpu2

Preflight reads every host first (one SSH command each, in parallel) and refuses the whole run, before any
operation executes, when any host fails a check: one line per problem, naming host, problem and fix.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

import gevent
from gevent.event import AsyncResult
from pyinfra import host, state
from pyinfra.api import Host, State, deploy
from pyinfra.api.exceptions import DeployError
from pyinfra.context import ctx_config, ctx_host

from gpufleet.errors import SettingErrors
from gpufleet.facts.host import GpufleetHost, Paths
from gpufleet.operations import docker, files, image, model, nvidia, preflight, service
from gpufleet.operations.context import HostContext, set_context, use_sudo
from gpufleet.settings import build_spec, merged_settings
from gpufleet.spec import ServeSpec
from gpufleet.unit import env_file_path, unit_path

HF_CACHE_SUBDIR = "huggingface"


@dataclass
class Plan:
    spec: ServeSpec
    settings: dict[str, Any]
    paths: Paths

    @property
    def cache_dirs(self) -> list[str]:
        models_mount = self.spec.mounts[0].host_path
        dirs = [m.host_path for m in self.spec.mounts if m.host_path != models_mount]
        return [*dirs, self.hf_cache]

    @property
    def hf_cache(self) -> str:
        return posixpath.join(self.settings["vllm_cache_dir"], HF_CACHE_SUBDIR)


def plan_for(name: str, data: dict[str, Any]) -> Plan:
    """Settings -> spec and the paths the snapshot reads (raises SettingErrors)."""
    spec = build_spec(name, data)
    s = merged_settings(data)
    models_dir = posixpath.normpath(s["vllm_models_dir"])
    cache = posixpath.normpath(s["vllm_cache_dir"])
    plan = Plan(spec, s, None)  # type: ignore[arg-type]
    plan.paths = Paths(
        service=spec.service, models_dir=models_dir, model=s["vllm_model"],
        dirs=(*plan.cache_dirs, cache, models_dir),
        files=(nvidia.KEYRING, nvidia.LIST, docker.DOCKER_KEY, docker.DOCKER_LIST, env_file_path(spec),
               unit_path(spec)),
        state_file=image.state_file(spec.service), env_file=env_file_path(spec), port=spec.port,
        nvidia_key_url=f"{s['nvidia_repo_url'].rstrip('/')}/gpgkey",
        docker_repo_url=s["docker_repo_url"].rstrip("/") if s["docker_install"] == "docker-ce" else None,
    )
    return plan


# --- preflight: every host, before anything changes --------------------------------------------------------
_PREFLIGHTS: dict[int, AsyncResult] = {}


def _inspect(state: State, target: Host) -> tuple[HostContext | None, Plan | None, list[str]]:
    with ctx_config.use(state.config.copy()), ctx_host.use(target):
        try:
            plan = plan_for(target.name, target.data.dict())
        except SettingErrors as errors:
            return None, None, [str(e) for e in errors.errors]
        try:
            snap = target.get_fact(GpufleetHost, paths=plan.paths, _sudo=use_sudo(target))
        except Exception as error:  # noqa: BLE001 - any failure to read the host is a preflight refusal
            return None, plan, [f"{target.name}: could not read the host: {error} (fix: check SSH and sudo)"]
        problems = preflight.check(target.name, snap, plan.settings, plan.spec.gpus)
        return HostContext(snapshot=snap, settings=plan.settings), plan, problems


def _run_preflight(state: State) -> dict[str, tuple[HostContext | None, Plan | None, list[str]]]:
    hosts = list(state.inventory.get_active_hosts())
    # Plain greenlets, not state.pool: this runs inside one of the pool's own greenlets.
    jobs = {h.name: (h, gevent.spawn(_inspect, state, h)) for h in hosts}
    gevent.joinall([job for _, job in jobs.values()])
    return {name: job.get() for name, (_, job) in jobs.items()}


def preflight_all() -> tuple[HostContext, Plan]:
    """Read and check every active host once per run; raise DeployError listing every failing host's problems."""
    key = id(state._get_module())
    if key not in _PREFLIGHTS:
        result = _PREFLIGHTS[key] = AsyncResult()
        try:
            result.set(_run_preflight(state._get_module()))
        except BaseException as error:
            result.set_exception(error)
            raise
    results = _PREFLIGHTS[key].get()
    problems = [line for _, _, lines in results.values() for line in lines]
    if problems:
        failing = sorted({name for name, (_, _, lines) in results.items() if lines})
        raise DeployError(f"preflight refused {len(failing)} of {len(results)} host(s); nothing was changed "
                          "on any host:\n  " + "\n  ".join(problems))
    ctx, plan, _ = results[host.name]
    set_context(host._get_module(), ctx)
    return ctx, plan


# --- the deploy ----------------------------------------------------------------------------------------------
@deploy("Deploy Qwen 3.5 on vLLM")
def deploy_qwen35() -> None:
    ctx, plan = preflight_all()
    s, spec = ctx.settings, plan.spec
    has_gpu = bool(ctx.snapshot.gpus)
    env_path = env_file_path(spec)

    files.prerequisites(name="Install apt prerequisites (ca-certificates, curl)")
    docker.engine(name="Install the Docker engine", install=s["docker_install"], repo_url=s["docker_repo_url"])
    nvidia.repository(name="Add the NVIDIA container toolkit apt repository", repo_url=s["nvidia_repo_url"])
    nvidia.toolkit(name="Install the NVIDIA container toolkit")
    runtime = nvidia.docker_runtime(name="Register the nvidia runtime with Docker")
    docker.running(name="Start the Docker engine")
    docker.restarted(name="Restart Docker to load its new configuration", _if=runtime.did_change)

    files.directories(name="Create the vLLM, torch, ComputeCache and HF cache directories",
                      paths=[*plan.cache_dirs], mode="755")
    files.directories(name="Create the models directory", paths=[plan.paths.models_dir], mode="755")
    secrets = service.env_file(name="Write the service's root-only secrets file", path=env_path,
                               secrets={"VLLM_API_KEY": "vllm_api_key", "HF_TOKEN": "vllm_hf_token"})
    pinned = image.pinned(name="Pull the vLLM image and pin its digest", image=spec.image, service=spec.service)
    model.present(name="Download the model unless it is complete", image=spec.image,
                  models_dir=plan.paths.models_dir, model=s["vllm_model"], repo=s["vllm_model_repo"],
                  revision=s["vllm_model_revision"], env_file=env_path if s["vllm_hf_token"] else None,
                  hf_cache=plan.hf_cache)
    unit = service.unit(name="Install the vLLM systemd unit", spec=spec, path=unit_path(spec))
    changes = [unit, secrets, pinned, runtime]
    service.running(name="Enable and start the vLLM service", service=spec.service, changes=changes,
                    start=has_gpu)
    # After a (re)start: ready, then still ready for vllm_ready_soak_s, or the unit that was serving goes back.
    service.ready(name="Verify vLLM is ready (/health, /v1/models)", spec=spec,
                  timeout_s=float(s["vllm_ready_timeout"]), changes=changes, start=has_gpu,
                  soak_s=float(s["vllm_ready_soak_s"]), unit_op=unit)
