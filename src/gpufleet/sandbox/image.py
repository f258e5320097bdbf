"""The stand-in vLLM image, pushed to the fleet's registry as <registry>/vllm/vllm-openai:<tag>.

A temporary dockerd, with no iptables and no bridge, imports a minimal root once per tag; a stamp in the registry
storage rebuilds it only when its inputs change.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

from gpufleet.sandbox import cache, procs
from gpufleet.sandbox.config import FleetConfig
from gpufleet.sandbox.procs import log, run
from gpufleet.sandbox.services import registry_storage
from gpufleet.sandbox.state import State
from gpufleet.vllm.flags import FLAGS_JSON

STANDIN = Path(__file__).parent / "standin"
REPOSITORY = "vllm/vllm-openai"
MODEL_REPO = "gpufleet-sandbox/Qwen3.5-tiny"  # the stand-in hub's model
# tag -> image env: one behaviour each, with its own digest (docs/test-hosts.md).
TAGS: dict[str, dict[str, str]] = {
    "good": {"STANDIN_VLLM_VERSION": "0.32.1.dev20+gstandin"},
    # "good" under another digest, for rollouts
    "good-next": {"STANDIN_VLLM_VERSION": "0.32.1.dev30+gstandin"},
    # before vLLM PR #34936
    "rejects-flag": {"STANDIN_VLLM_VERSION": "0.16.0", "STANDIN_UNKNOWN_FLAGS": "--performance-mode"},
    "dies": {"STANDIN_VLLM_VERSION": "0.32.1.dev21+gstandin", "STANDIN_DIE_AFTER": "8"},
    "models-not-json": {"STANDIN_VLLM_VERSION": "0.32.1.dev22+gstandin", "STANDIN_MISBEHAVE": "models-not-json"},
    "not-http": {"STANDIN_VLLM_VERSION": "0.32.1.dev23+gstandin", "STANDIN_MISBEHAVE": "not-http"},
    "completions-fail": {"STANDIN_VLLM_VERSION": "0.32.1.dev24+gstandin", "STANDIN_MISBEHAVE": "completions-fail"},
    "stream-broken": {"STANDIN_VLLM_VERSION": "0.32.1.dev25+gstandin", "STANDIN_MISBEHAVE": "stream-broken"},
    "cache-corrupt": {"STANDIN_VLLM_VERSION": "0.32.1.dev26+gstandin", "STANDIN_MISBEHAVE": "cache-corrupt"},
    "tools-broken": {"STANDIN_VLLM_VERSION": "0.32.1.dev27+gstandin", "STANDIN_MISBEHAVE": "tools-broken"},
    "slow": {"STANDIN_VLLM_VERSION": "0.32.1.dev28+gstandin", "STANDIN_MISBEHAVE": "slow"},
    "stalls-under-load": {"STANDIN_VLLM_VERSION": "0.32.1.dev29+gstandin", "STANDIN_MISBEHAVE": "stalls-under-load"},
}
# more tags of the same digest; the deploy's default image ref names "nightly"
ALIASES = {"nightly": "good"}
COMMON_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "NVIDIA_REQUIRE_CUDA": "cuda>=13.0",
    "NVIDIA_VISIBLE_DEVICES": "all",
    "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
    "VLLM_USAGE_SOURCE": "production-docker-image",
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": "/opt/gpufleet-standin",  # for the rollout's compile-hash check
}
VLLM_MODULES = (
    "vllm_serve.py",
    "vllm_argv.py",
    "vllm_engine.py",
    "vllm_chat.py",
    "vllm_http.py",
    "vllm_compile_cache.py",
    "vllm_envs.py",
    "vllm_group.py",
)
# The image's /opt (name -> source); the image's key hashes every one.
SOURCES = {**{name: STANDIN / name for name in VLLM_MODULES}, "hf.py": STANDIN / "hf.py", "vllm_flags.json": FLAGS_JSON}


def image_ref(cfg: FleetConfig, tag: str = "nightly") -> str:
    return f"{cfg.registry}/{REPOSITORY}:{tag}"


def _key(base_rootfs: Path) -> str:
    h = hashlib.sha256(str(base_rootfs).encode() + json.dumps([TAGS, ALIASES, COMMON_ENV, MODEL_REPO]).encode())
    for f in (*SOURCES.values(), Path(__file__)):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def ensure_images(cfg: FleetConfig, state: State, base_rootfs: Path) -> None:
    """Make sure the registry holds every tag of the current stand-in."""
    key = _key(base_rootfs)
    stamp = registry_storage(cfg) / ".gpufleet-images"
    if stamp.exists() and stamp.read_text() == key:
        return
    tar = image_tar(cfg.cache_dir, base_rootfs)
    log.info("importing and pushing %s:{%s} (temporary dockerd)", REPOSITORY, ",".join([*TAGS, *ALIASES]))
    work = cfg.state_dir / "dockerd"
    run_dir = dockerd_run_dir(cfg)  # a unix socket path must stay under 108 bytes
    for d in (work, run_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    sock = f"unix://{run_dir}/docker.sock"
    pid = procs.spawn(
        [
            "dockerd",
            "--data-root",
            str(work / "root"),
            "--exec-root",
            str(run_dir / "exec"),
            "--pidfile",
            str(run_dir / "dockerd.pid"),
            "-H",
            sock,
            "--iptables=false",
            "--ip6tables=false",
            "--ip-forward=false",
            "--ip-masq=false",
            "--bridge=none",
            "--userland-proxy=false",
            "--insecure-registry",
            cfg.registry,
        ],
        work / "dockerd.log",
    )
    state.add_pid("dockerd", pid)
    docker = ["docker", "-H", sock]
    try:
        procs.wait_for(lambda: run([*docker, "info"], check=False).returncode == 0, 60, "the temporary dockerd")
        for tag, env in TAGS.items():
            changes = [f"ENV {k}={v}" for k, v in {**COMMON_ENV, **env}.items()]
            changes += ['ENTRYPOINT ["vllm", "serve"]', "WORKDIR /", f"LABEL org.gpufleet.standin={tag}"]
            run([*docker, "import", *[a for c in changes for a in ("-c", c)], str(tar), image_ref(cfg, tag)])
            run([*docker, "push", image_ref(cfg, tag)], timeout=300)
        for alias, tag in ALIASES.items():
            run([*docker, "tag", image_ref(cfg, tag), image_ref(cfg, alias)])
            run([*docker, "push", image_ref(cfg, alias)], timeout=300)
    finally:
        procs.stop(pid, grace=20)
        state.drop_pid("dockerd")
        remove_dockerd_dirs(cfg)
    stamp.write_text(key)


def dockerd_run_dir(cfg: FleetConfig) -> Path:
    return Path("/run") / f"gf-{cfg.name}-dockerd"


def remove_dockerd_dirs(cfg: FleetConfig) -> None:
    """What the temporary dockerd leaves: its exec-root mounts and both of its directories."""
    from gpufleet.sandbox.hosts import unmount_below

    for d in (dockerd_run_dir(cfg), cfg.state_dir / "dockerd"):
        unmount_below(d)
        shutil.rmtree(d, ignore_errors=True)


def image_tar(cache_dir: Path, base: Path) -> Path:
    """The stand-in image's root as a tar, built once per key: what `docker import` makes each tag of."""
    key = _key(base)
    out = cache_dir / f"vllm-image-{key}.tar"
    if out.exists():
        return out
    # Fleets starting at once would build in, and delete, the same root dir.
    with cache.building(cache_dir / f".vllm-image-{key}.lock"):
        if not out.exists():
            _build_image_tar(base, cache_dir / f"vllm-image-{key}.root", out)
    return out


def _build_image_tar(base: Path, root: Path, out: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    for d in ("usr/bin", "usr/lib", "usr/lib64", "tmp", "etc", "root", "opt/gpufleet-standin"):
        (root / d).mkdir(parents=True)
    for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
        (root / link).symlink_to(target)
    (root / "tmp").chmod(0o1777)
    for exe in ("python3.11", "dash"):
        shutil.copy2(base / "usr/bin" / exe, root / "usr/bin" / exe)
    (root / "usr/bin/python3").symlink_to("python3.11")
    (root / "usr/bin/sh").symlink_to("dash")
    run(
        [
            "tar",
            "-C",
            str(base),
            "-c",
            "--exclude=test",
            "--exclude=tests",
            "--exclude=idlelib",
            "--exclude=tkinter",
            "--exclude=turtledemo",
            "--exclude=ensurepip",
            "--exclude=lib2to3",
            "--exclude=__pycache__",
            "-f",
            str(root / "py.tar"),
            "usr/lib/python3.11",
        ]
    )
    run(["tar", "-C", str(root), "-xf", str(root / "py.tar")])
    (root / "py.tar").unlink()
    _copy_libraries(base, root)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")
    opt = root / "opt/gpufleet-standin"
    install_sources(opt)
    for command, script in (("vllm", "vllm_serve.py"), ("hf", "hf.py")):
        (opt / script).chmod(0o755)
        (root / "usr/bin" / command).symlink_to(f"/opt/gpufleet-standin/{script}")
    write_tiny_model(opt / "hub" / MODEL_REPO)  # for a run without the deploy
    run(["tar", "-C", str(root), "--numeric-owner", "--owner=0", "--group=0", "-cf", str(out) + ".tmp", "."])
    Path(str(out) + ".tmp").rename(out)
    shutil.rmtree(root)


def install_sources(opt: Path) -> None:
    """The stand-ins and the flag table into the image's /opt/gpufleet-standin, as SOURCES names them."""
    for name, src in SOURCES.items():
        shutil.copy(src, opt / name)
    # The names of vLLM's package that the rollout's compile-hash script imports.
    package = opt / "vllm"
    (package / "config").mkdir(parents=True, exist_ok=True)
    shutil.copy(STANDIN / "vllm_envs.py", package / "envs.py")
    (package / "__init__.py").write_text('import os\n__version__ = os.environ.get("STANDIN_VLLM_VERSION", "0.32.0")\n')
    (package / "config" / "__init__.py").write_text("")
    (package / "config" / "utils.py").write_text("from vllm.envs import hash_factors  # noqa: F401\n")


def _copy_libraries(base: Path, root: Path) -> None:
    """The shared libraries python3.11, its extension modules and dash link against, resolved inside the base."""
    # glibc dlopen()s libgcc_s when a thread exits, and ldd does not list it.
    dlopened = {"/usr/lib/x86_64-linux-gnu/libgcc_s.so.1"}
    targets = ["/usr/bin/python3.11", "/usr/bin/dash", *dlopened]
    targets += [f"/{p.relative_to(base)}" for p in (base / "usr/lib/python3.11/lib-dynload").glob("*.so")]
    out = run(["chroot", str(base), "ldd", *targets], check=False).stdout
    libs = {
        tok
        for line in out.splitlines()
        for tok in line.split()
        if tok.startswith("/") and ".so" in tok and not tok.endswith(":")
    } | dlopened
    for lib in sorted(libs):
        dst = root / ("usr" + lib if not lib.startswith("/usr/") else lib[1:]).lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(base / lib.lstrip("/"), dst)


def write_tiny_model(d: Path) -> None:
    """A tiny, structurally real model: config.json, tokenizer files, and a valid safetensors file.

    The format is simple enough to write here rather than depend on the test extras' safetensors."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "model_type": "qwen3_5_moe",
                "hidden_size": 64,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                "max_position_embeddings": 262144,
                "vocab_size": 256,
                "torch_dtype": "bfloat16",
            },
            indent=2,
        )
        + "\n"
    )
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}) + "\n")
    vocab = {chr(i) if 33 <= i < 127 else f"<0x{i:02X}>": i for i in range(256)}
    (d / "tokenizer.json").write_text(
        json.dumps(
            {
                "version": "1.0",
                "added_tokens": [],
                "normalizer": None,
                "pre_tokenizer": None,
                "post_processor": None,
                "decoder": None,
                "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<0x00>"},
            }
        )
        + "\n"
    )
    (d / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 262144}) + "\n"
    )
    data = bytes(range(256)) * 16
    header = json.dumps(
        {
            "model.embed_tokens.weight": {"dtype": "U16", "shape": [256, 8], "data_offsets": [0, len(data)]},
            "__metadata__": {"format": "pt"},
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
