"""The checks preflight runs on a vLLM host: snapshot and settings in, one line per problem out."""

from __future__ import annotations

from collections.abc import Callable

from gpufleet.facts.gpu_verdict import HostGpus
from gpufleet.facts.nvidia import version_tuple
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.operations.model import missing_parts
from gpufleet.vllm.settings import VllmSettings

Bad = Callable[[str, str], None]
SUPPORTED_OS = {"debian", "ubuntu"}
SUPPORTED_ARCH = {"amd64", "arm64", "x86_64", "aarch64"}
KIB_PER_GIB = 1024 * 1024
# Each docker_install value's packages conflict with the other's: apt would remove them under running containers.
ENGINES = {"docker-ce": ("docker-ce", "containerd.io"), "distro": ("docker.io", "containerd")}
MANAGED_HEADER = "# Managed by gpufleet"


def _line(host: str, what: str, fix: str) -> str:
    return f"{host}: {what} (fix: {fix})"


def check(host: str, snap: HostSnapshot, s: VllmSettings, gpus: tuple[int, ...], ref: str | None = None) -> list[str]:
    """What would make the deploy fail or serve wrongly; `ref` is the digest to install, when known."""
    problems: list[str] = []

    def bad(what: str, fix: str) -> None:
        problems.append(_line(host, what, fix))

    os_id = snap.os.get("ID", "unknown")
    if os_id not in SUPPORTED_OS and not (set(snap.os.get("ID_LIKE", "").split()) & SUPPORTED_OS):
        bad(
            f"OS {snap.os.get('PRETTY_NAME', os_id)!r} is not Debian or Ubuntu",
            "use a Debian 12+ or Ubuntu 22.04+ host",
        )
    if snap.arch not in SUPPORTED_ARCH:
        bad(f"architecture {snap.arch or 'unknown'!r} is not supported", "use an amd64 or arm64 host")

    if snap.nvidia_error:
        bad(
            f"nvidia-smi does not work: {snap.nvidia_error}",
            "repair the NVIDIA driver install (nvidia-smi must list the GPUs)",
        )
    elif not snap.gpus:
        if not s.allow_no_gpu:
            where = "nvidia-smi lists no GPU" if snap.nvidia_smi else "no NVIDIA driver (nvidia-smi not found)"
            bad(
                where,
                "install the NVIDIA driver (R580+), or set gpufleet_allow_no_gpu=True to install "
                "everything without starting the service",
            )
    else:
        count = len(snap.gpus)
        beyond = [g for g in gpus if g >= count]
        if beyond:
            bad(
                f"vllm_gpus {list(gpus)} needs GPU index {max(beyond)}, the host has {count} GPU(s) "
                f"({snap.gpus[0].name})",
                f"list GPU indexes below {count} in vllm_gpus (and match TP x PP)",
            )
        if snap.driver is None:
            bad("nvidia-smi --version reports no CUDA version", "repair the NVIDIA driver install")
        else:
            minimum = s.min_cuda
            if snap.driver.cuda < version_tuple(minimum):
                bad(
                    f"driver {snap.driver.driver_version} supports CUDA {snap.driver.cuda_version}, the image needs "
                    f"CUDA >= {minimum}",
                    "upgrade the NVIDIA driver (R580+ for CUDA 13), or use an image built "
                    "for the older CUDA and lower gpufleet_min_cuda",
                )

    _check_engine(bad, snap, s.docker_install)
    _check_service_unit(bad, snap, s.service)

    if snap.daemon_json_error:
        bad(snap.daemon_json_error, "repair /etc/docker/daemon.json (the deploy merges into it, never replaces it)")

    # Space is needed only for what still has to land.
    docker_gb = 0.0 if ref and snap.has_image_digest(ref) else float(s.min_free_gb_docker)
    if docker_gb:
        _need_space(bad, snap, "docker", docker_gb, "gpufleet_min_free_gb_docker", "Docker images")
    if snap.site_cache_used_kib is not None:
        _need_cache_space(bad, snap, float(s.site_cache_max_gb), docker_gb)
    missing = missing_parts(snap)
    if missing and not s.model_repo:
        bad(
            f"{s.models_dir}/{s.model} lacks {missing[0]} and vllm_model_repo is None",
            "stage the model there by hand, or set vllm_model_repo to download it",
        )
    # A model to download: incomplete, or another commit asked for.
    moving = s.model_sha and snap.model_checked != f"{s.model_repo}@{s.model_sha}"
    if missing or moving:
        _need_space(bad, snap, "models", s.min_free_gb_models, "gpufleet_min_free_gb_models", "models")
    return problems


def gpu_refusals(host: str, gpus: HostGpus, used: tuple[int, ...], restart: str | None) -> list[str]:
    """One line per used GPU whose verdict refuses the (re)start `restart` names."""
    if restart is None:
        return []
    return [
        _line(
            host,
            f"{g.line()}: this converge would {restart}",
            f"{g.action}, then converge again (docs/gpu-health.md: how a verdict clears)",
        )
        for g in gpus.blocking(used)
    ]


def _check_engine(bad: Bad, snap: HostSnapshot, install: str) -> None:
    """Refuse a Docker engine the deploy would swap out."""
    if install not in ENGINES:
        return  # build_spec reports it
    other = next(kind for kind in ENGINES if kind != install)
    found = [p for p in ENGINES[other] if snap.installed(p)]
    if found:
        listed = ", ".join(f"{p} {snap.packages[p]}" for p in found)
        them = "them" if len(found) > 1 else "it"
        bad(
            f"docker_install is {install!r}, but {listed} {'are' if len(found) > 1 else 'is'} installed: apt would "
            f"remove {them} to install {ENGINES[install][0]}, stopping every container on this host",
            f"set docker_install to {other!r} for this host to keep {them}, or remove {' '.join(found)} by hand first",
        )


def _check_service_unit(bad: Bad, snap: HostSnapshot, service: str) -> None:
    """Refuse to replace and restart a unit gpufleet did not write."""
    unit = snap.service_unit
    if unit is None or not unit.exists or unit.first_line.startswith(MANAGED_HEADER):
        return
    origin = unit.fragment_path or f"load state {unit.load_state}"
    if unit.load_state == "masked":
        origin = f"masked at {unit.fragment_path}" if unit.fragment_path else "masked"
    bad(
        f"vllm_service {service!r} is {unit.name}, a unit gpufleet did not create ({origin}): the deploy would "
        "replace and restart it",
        "set vllm_service to a name no unit on this host uses yet (gpufleet then creates that unit)",
    )


def _need_cache_space(bad: Bad, snap: HostSnapshot, max_gb: float, docker_gb: float) -> None:
    """Room for the site cache to grow to site_cache_max_gb, plus the image's on a shared filesystem."""
    used, free = snap.site_cache_used_kib or 0, snap.free_kib.get("site_cache")
    kept = used if used <= max_gb * KIB_PER_GIB else 0
    need = max_gb * KIB_PER_GIB - kept + (docker_gb * KIB_PER_GIB if snap.site_cache_shares_docker else 0)
    if free is None:
        bad("could not measure free space for the site cache", "check that df works on the host")
    elif free + (used - kept) < need:
        also = (
            f" and gpufleet_min_free_gb_docker {docker_gb:g} beside it"
            if docker_gb and snap.site_cache_shares_docker
            else ""
        )
        bad(
            f"{free / KIB_PER_GIB:.1f} GiB free at {snap.free_path.get('site_cache')} (the site cache, holding "
            f"{used / KIB_PER_GIB:.1f} GiB), site_cache_max_gb asks for {max_gb:g}{also}",
            "free space there, or lower site_cache_max_gb",
        )


def _need_space(bad: Bad, snap: HostSnapshot, key: str, need_gb: float, setting: str, what: str) -> None:
    free = snap.free_kib.get(key)
    if free is None:
        bad(f"could not measure free space for {what}", "check that df works on the host")
    elif free < need_gb * KIB_PER_GIB:
        bad(
            f"{free / KIB_PER_GIB:.1f} GiB free at {snap.free_path.get(key)} ({what}), {setting} asks for {need_gb}",
            f"free space there, or lower {setting}",
        )
