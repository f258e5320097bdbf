"""The model: present and complete under vllm_models_dir, or downloaded (resumably) with the serving image's hf CLI."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import FunctionCommand, Host, State, operation

from gpufleet.operations.base import Commands, fail
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.layout import Layout, Managed
from gpufleet.vllm.operations.image import TIMED_OUT, run_bounded, target_ref
from gpufleet.vllm.snapshot import snapshot
from gpufleet.vllm.spec import ServeSpec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def managed(layout: Layout) -> Managed:
    # The model's own files are hf's to write; the deploy owns the directories the download writes into.
    return Managed(dirs=(layout.models_dir, layout.hf_cache))


def missing_parts(snap: HostSnapshot) -> list[str]:
    """What keeps the model directory from being servable ([] = complete)."""
    files = snap.model_files
    missing = []
    if "config.json" not in files:
        missing.append("config.json")
    if not any(name in files for name in TOKENIZER_FILES):
        missing.append("a tokenizer (" + " / ".join(TOKENIZER_FILES) + ")")
    weights = {name: size for name, size in files.items() if name.endswith(".safetensors")}
    if not weights:
        missing.append("weights (*.safetensors)")
    absent = [s for s in snap.model_shards if weights.get(s, 0) == 0]
    if absent:
        missing.append(f"{len(absent)} of {len(snap.model_shards)} shards listed in model.safetensors.index.json "
                       f"(e.g. {absent[0]})")
    empty = [name for name, size in weights.items() if size == 0]
    if empty:
        missing.append(f"non-empty weights ({empty[0]} is 0 bytes)")
    if snap.model_incomplete:
        missing.append("an unfinished download (" + snap.model_incomplete[0] + ")")
    return missing


def _download(state: State, host: Host, spec: ServeSpec, repo: str, revision: str | None, env_file: str | None,
              hf_cache: str, pin: str | None, timeout_s: float | None = None) -> bool:
    ref = target_ref(pin, host) or spec.image  # the digest pinned() resolved in this run, or the pin
    argv = spec.hf_download_argv(ref, repo, revision, hf_cache, env_file)
    # hf's progress streams to the terminal; re-running resumes from the partial files. Ended past timeout_s: the
    # SIGTERM reaches the container through docker run's signal proxy.
    ok, lines = run_bounded(host, " ".join(shlex.quote(a) for a in argv), timeout_s)
    if not ok and lines and lines[-1].strip() == TIMED_OUT:
        return fail(host, f"{host.name}: the model download of {repo} did not finish within vllm_fetch_timeout_s = "
                          f"{timeout_s:g} s and was ended (fix: check that {host.name} reaches the hub; re-running "
                          "resumes, and a slow line needs a larger vllm_fetch_timeout_s)")
    if not ok:
        return fail(host, f"model download of {repo} failed: {' | '.join(lines[-3:])} "
                          "(fix: check vllm_model_repo / vllm_hf_token; re-running resumes)")
    return True


@operation()
def present(spec: ServeSpec, where: str, repo: str | None, revision: str | None, env_file: str | None,
            hf_cache: str, pin: str | None, timeout_s: float | None = None) -> Commands:
    """Download the model unless it is complete in `where` (the host directory the spec's --model reads), with the
    serving image: the one this run's pull resolved, else `pin` (the digest this run installs, when known before).

    env_file: the root-only file holding HF_TOKEN, or None without a token (the token never is an argument)."""
    snap = snapshot()
    missing = missing_parts(snap)
    if not missing:
        weights = sum(1 for name in snap.model_files if name.endswith(".safetensors"))
        host.noop(f"{where} is complete (config, tokenizer, {weights} weight file(s))")
        return
    if not repo:
        # Preflight refuses this case; kept so the operation is safe on its own.
        raise ValueError(f"{where} lacks {missing[0]} and vllm_model_repo is None")
    yield FunctionCommand(_download, (spec, repo, revision, env_file, hf_cache, pin), {"timeout_s": timeout_s})
