"""The stand-in NVIDIA container toolkit: nvidia-ctk merges daemon.json; the hook accepts the host's GPUs and
rejects others the way nvidia-container-cli does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.sandbox import nvidia_repo, nvidia_smi

STANDIN = nvidia_repo.STANDIN


def ctk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(STANDIN / "nvidia_ctk.py"), *args], capture_output=True, text=True)


def test_runtime_configure_merges_and_keeps_other_keys(tmp_path: Path):
    cfg = tmp_path / "daemon.json"
    cfg.write_text(json.dumps({"insecure-registries": ["10.213.1.1:5000"], "log-driver": "journald"}))
    out = ctk("runtime", "configure", "--runtime=docker", f"--config={cfg}")
    assert out.returncode == 0 and f"Wrote updated config to {cfg}" in out.stdout
    assert json.loads(cfg.read_text()) == {
        "insecure-registries": ["10.213.1.1:5000"],
        "log-driver": "journald",
        "runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}},
    }
    before = cfg.read_text()
    ctk("runtime", "configure", "--runtime=docker", f"--config={cfg}")
    assert cfg.read_text() == before  # idempotent: a second converge changes nothing


def test_configure_creates_a_missing_file_and_version(tmp_path: Path):
    cfg = tmp_path / "etc/docker/daemon.json"
    assert ctk("runtime", "configure", "--runtime=docker", f"--config={cfg}").returncode == 0
    assert json.loads(cfg.read_text())["runtimes"]["nvidia"]["path"] == "nvidia-container-runtime"
    assert ctk("--version").stdout.startswith("NVIDIA Container Toolkit CLI version 1.17.8\n")


def _hook(tmp_path: Path, devices: str, profile: nvidia_smi.Profile | None) -> subprocess.CompletedProcess:
    """Run the hook as runc would, against a bundle asking for `devices`, on a host with `profile` GPUs."""
    host = tmp_path / "host"
    nvidia_smi.write_host_files(host, profile)
    bundle = tmp_path / "bundle"
    (bundle / "rootfs/usr/bin").mkdir(parents=True, exist_ok=True)
    (bundle / "rootfs/usr/bin/python3").touch()
    (bundle / "config.json").write_text(
        json.dumps({"root": {"path": "rootfs"}, "process": {"env": [f"NVIDIA_VISIBLE_DEVICES={devices}"]}})
    )
    source = (STANDIN / "nvidia_container_runtime_hook.py").read_text()
    source = source.replace('"/etc/gpufleet-standin/nvidia-smi.json"', repr(str(host / nvidia_smi.HOST_PROFILE[1:])))
    source = source.replace('"/usr/lib/gpufleet-standin"', repr(str(host / "usr/lib/gpufleet-standin")))
    return subprocess.run(
        [sys.executable, "-c", source, "prestart"],
        input=json.dumps({"bundle": str(bundle)}),
        capture_output=True,
        text=True,
    )


def test_hook_gives_the_container_its_gpus_renumbered(tmp_path: Path):
    out = _hook(tmp_path, "1,2", nvidia_smi.make_profile(3, seed="h"))
    assert out.returncode == 0, out.stderr
    inside = nvidia_smi.Profile.from_json((tmp_path / "bundle/rootfs" / nvidia_smi.HOST_PROFILE[1:]).read_text())
    host = nvidia_smi.make_profile(3, seed="h")
    assert [(g.index, g.uuid) for g in inside.gpus] == [(0, host.gpus[1].uuid), (1, host.gpus[2].uuid)]


@pytest.mark.parametrize(
    ("devices", "profile", "error"),
    [
        ("0,1,2,3", nvidia_smi.make_profile(3), "nvidia-container-cli: device error: 3: unknown device"),
        ("0", None, "libnvidia-ml.so.1: cannot open shared object file"),
    ],
)
def test_hook_rejects_what_the_host_lacks(tmp_path: Path, devices, profile, error):
    out = _hook(tmp_path, devices, profile)
    assert out.returncode == 1 and error in out.stderr


def _runtime():
    import importlib.util

    spec = importlib.util.spec_from_file_location("standin_runtime", STANDIN / "nvidia_container_runtime.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runtime_adds_the_hook_once_and_only_for_gpu_containers():
    rt = _runtime()
    gpu = {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=0,1"]}}
    rt.add_hook(gpu)
    rt.add_hook(gpu)
    assert gpu["hooks"]["prestart"] == [{"path": rt.HOOK, "args": [rt.HOOK, "prestart"]}]
    plain = {"process": {"env": ["PATH=/usr/bin"]}}
    rt.add_hook(plain)
    assert "hooks" not in plain


def test_runtime_keeps_exactly_the_capabilities_this_machine_has():
    rt = _runtime()
    bounding = int(
        next(
            line.split()[1] for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapBnd:")
        ),
        16,
    )
    have = [n for bit, n in enumerate(rt.CAPABILITIES) if bounding >> bit & 1]
    spec = {"process": {"capabilities": {"bounding": list(rt.CAPABILITIES), "effective": ["CAP_CHOWN"]}}}
    rt.clamp_capabilities(spec)
    assert spec["process"]["capabilities"]["bounding"] == have
    assert spec["process"]["capabilities"]["effective"] == (["CAP_CHOWN"] if "CAP_CHOWN" in have else [])
