"""From a bare GPU host to a verified vLLM service running Qwen 3.5, idempotently.

    pyinfra inventories/lab.py deploys/qwen35.py           # converge every host
    pyinfra inventories/lab.py deploys/qwen35.py --dry     # show what would change
    pyinfra inventories/lab.py deploys/qwen35.py --limit gpu2

The playbook only: gpufleet.deploys.preflight reads and checks every host first (one SSH command each, in
parallel) and refuses the whole run, before any operation executes, when any host fails a check;
gpufleet.deploys.verify is the verify step's callback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pyinfra.api import deploy

from gpufleet.deploys import preflight
from gpufleet.deploys.verify import Verification
from gpufleet.facts.host import HostSnapshot, Paths
from gpufleet.operations import docker, files, image, managed_paths, model, nvidia, service
from gpufleet.operations.layout import Layout
from gpufleet.operations.secret import Hidden
from gpufleet.operations.snapshot import snapshot
from gpufleet.settings import resolve_host
from gpufleet.spec import ServeSpec


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
    spec, s = resolve_host(name, data)
    layout = Layout.of(spec, s["vllm_cache_dir"])
    managed = managed_paths(layout)
    paths = Paths(
        service=spec.service, models_dir=layout.models_dir, model_dir=layout.model_dir, dirs=managed.dirs,
        files=managed.files, state_file=layout.state_file, env_file=layout.env_file, port=spec.port,
        nvidia_key_url=nvidia.key_url(s["nvidia_repo_url"]),
        docker_repo_url=s["docker_repo_url"].rstrip("/") if s["docker_install"] == "docker-ce" else None,
    )
    return Plan(spec, s, layout, paths)


def check_host(name: str, snap: HostSnapshot, plan: Plan) -> list[str]:
    return preflight.check(name, snap, plan.settings, plan.spec.gpus)


@deploy("Deploy Qwen 3.5 on vLLM")
def deploy_qwen35() -> None:
    plan = preflight.preflight(plan_for, check_host)
    s, spec, layout = plan.settings, plan.spec, plan.layout
    has_gpu = bool(snapshot().gpus)

    files.prerequisites(name="Install apt prerequisites (ca-certificates, curl)")
    docker.engine(name="Install the Docker engine", install=s["docker_install"], repo_url=s["docker_repo_url"])
    nvidia.repository(name="Add the NVIDIA container toolkit apt repository", repo_url=s["nvidia_repo_url"])
    nvidia.toolkit(name="Install the NVIDIA container toolkit")
    runtime = nvidia.docker_runtime(name="Register the nvidia runtime with Docker")
    docker.running(name="Start the Docker engine")
    docker.restarted(name="Restart Docker to load its new configuration", _if=runtime.did_change)

    files.directories(name="Create the vLLM, torch and ComputeCache cache directories",
                      paths=list(service.managed(layout).dirs), mode="755")
    files.directories(name="Create the models and model download cache directories",
                      paths=list(model.managed(layout).dirs), mode="755")
    secrets = service.env_file(name="Write the service's root-only secrets file", path=layout.env_file,
                               secrets=service.hidden_secrets(s))
    pinned = image.pinned(name="Pull the vLLM image and pin its digest", image=spec.image,
                          state_file=layout.state_file)
    model.present(name="Download the model unless it is complete", spec=spec, where=layout.model_dir,
                  repo=s["vllm_model_repo"], revision=s["vllm_model_revision"],
                  env_file=layout.env_file if s["vllm_hf_token"] else None, hf_cache=layout.hf_cache)
    unit = service.unit(name="Install the vLLM systemd unit", spec=spec, path=layout.unit_file)
    changes = [unit, secrets, pinned, runtime]
    service.running(name="Enable and start the vLLM service", service=spec.service, changes=changes,
                    start=has_gpu)
    # After a (re)start: ready, then still ready for vllm_ready_soak_s, or the unit that was serving goes back.
    api_key = s["vllm_api_key"]
    verify = Verification(spec, float(s["vllm_ready_timeout"]), Hidden(api_key) if api_key else None)
    service.ready(name="Verify vLLM is ready (/health, /v1/models)", spec=spec, layout=layout, verify=verify.run,
                  changes=changes, start=has_gpu, soak_s=float(s["vllm_ready_soak_s"]), unit_op=unit)
