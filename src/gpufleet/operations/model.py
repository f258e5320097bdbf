"""The model: present and complete under vllm_models_dir, or downloaded (resumably) with the serving image's hf CLI."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import FunctionCommand, operation

from gpufleet.facts.host import HostSnapshot
from gpufleet.operations.context import context, fail, snapshot, use_sudo

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


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


def download_argv(image_ref: str, models_dir: str, model: str, repo: str, revision: str | None,
                  env_file: str | None, hf_cache: str | None) -> list[str]:
    """`docker run --rm --entrypoint hf ... download`: the token, if any, only through the root-only env file."""
    argv = ["docker", "run", "--rm", "--entrypoint", "hf", "-v", f"{models_dir}:/models"]
    if hf_cache:
        argv += ["-v", f"{hf_cache}:/root/.cache/huggingface"]
    if env_file:
        argv += ["--env-file", env_file]
    argv += [image_ref, "download", repo, "--local-dir", f"/models/{model}"]
    if revision:
        argv += ["--revision", revision]
    return argv


def _download(state, host, image: str, models_dir: str, model: str, repo: str, revision: str | None,
              env_file: str | None, hf_cache: str | None) -> bool:
    from gpufleet.operations.image import pinned_ref

    ctx = context(host)
    ref = ctx.resolved.get("image_ref") or pinned_ref(ctx.snapshot.state, image) or image
    argv = download_argv(ref, models_dir, model, repo, revision, env_file, hf_cache)
    # print_output: hf's progress streams to the terminal; re-running resumes from the partial files.
    ok, output = host.run_shell_command(" ".join(shlex.quote(a) for a in argv), _sudo=use_sudo(host),
                                        print_output=True)
    if not ok:
        return fail(host, f"model download of {repo} failed: {' | '.join(output.output_lines[-3:])} "
                          "(fix: check vllm_model_repo / vllm_hf_token; re-running resumes)")
    return True


@operation()
def present(image: str, models_dir: str, model: str, repo: str | None, revision: str | None,
            env_file: str | None, hf_cache: str | None):
    """Download the model unless it is complete in the models dir."""
    missing = missing_parts(snapshot())
    if not missing:
        weights = sum(1 for name in snapshot().model_files if name.endswith(".safetensors"))
        host.noop(f"{models_dir}/{model} is complete (config, tokenizer, {weights} weight file(s))")
        return
    if not repo:
        # Preflight refuses this case; kept so the operation is safe on its own.
        raise ValueError(f"{models_dir}/{model} lacks {missing[0]} and vllm_model_repo is None")
    yield FunctionCommand(_download, (image, models_dir, model, repo, revision, env_file, hf_cache), {})
