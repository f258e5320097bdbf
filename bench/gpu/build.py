"""Build what the GPU machine needs for the evidence run (docs/gpu.md), here, from the package registries: the vLLM
release whose torch pin matches that machine's torch, stripped of what an H200 does not use, every requirement the
machine's image lacks (bench/gpu/image-packages.txt), and what gpufleet's own code imports there; installed into
one tree, packed with xz and split into pieces that each fit one device call beside the repo.

    python bench/gpu/build.py /work/main/.gpurun        # then carry .gpurun/p1 .. .gpurun/pN, one a call

Writes OUT/pN/payload.tar.xz.NN (one piece per folder, so each call carries one), OUT/manifest.json (versions,
sizes, what was stripped and why, the xz/zstd comparison) and OUT/SHA256SUMS. Downloads are kept in --cache."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

HERE = Path(__file__).resolve().parent
VLLM = "0.24.0"  # pins torch==2.11.0, the GPU machine's torch (cu130, Python 3.12)
# pip matches a manylinux tag exactly: every glibc up to the machine's (Ubuntu 24.04: 2.39).
PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)),
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)
# The machine's interpreter, for requirement markers.
TARGET_ENV = default_environment() | {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
}
# Versions that worked on the H200 (../shared notes, 2026-12-03): the newest releases of these broke vLLM 0.24.
PINS = {
    "openai": "2.44.0",
    "anthropic": "0.115.0",
    "mcp": "1.28.1",
    "starlette": "1.3.1",
    "pydantic": "2.13.4",
    "xgrammar": "0.2.5.post1",
}  # the newest xgrammar whose apache-tvm-ffi range holds vLLM's pin (0.1.9)
# vLLM 0.24's requirements left out, and why: the run uses none of them on an H200 (docs/gpu.md).
NOT_CARRIED = {
    "flashinfer-python": "not carried: GDN prefill runs on Triton (gdn_prefill_backend), the sampler is off",
    "flashinfer-cubin": "FlashInfer's kernels, as above",
    "tilelang": "kernel DSL for other models' kernels",
    "nvidia-cudnn-frontend": "cuDNN attention backends, not selected on SM90",
    "fastsafetensors": "an optional GDS loader",
    "nvidia-cutlass-dsl": "CuTe DSL kernels for SM100",
    "quack-kernels": "CuTe DSL kernels for SM100",
    "tokenspeed-mla": "MLA (DeepSeek) kernels",
    "humming-kernels": "quantised GEMM kernels for other checkpoints",
    "types-paramiko": "type stubs (pyinfra's requirement), nothing to import",
}
# gpufleet's own runtime requirements that the driver's imports reach (gpufleet.remote patches with gevent and
# imports paramiko; the carry's modules import pyinfra), at the versions the project's venv runs.
GPUFLEET = (
    "gevent==26.9.0",
    "greenlet==3.5.6",
    "zope.event==6.2",
    "zope.interface==8.7",
    "paramiko==4.0.0",
    "bcrypt==5.0.0",
    "cryptography==50.0.2",
    "pynacl==1.6.2",
    "cffi==2.1.1",
    "pycparser==3.12",
    "invoke==3.0.3",
    "pyinfra==3.10.0",
    "distro==1.9.0",
    "typeguard==4.6.1",
)
# What the run does not load: in vLLM's wheel, SM80 FlashAttention 2 (Hopper runs FA3), the Rust frontend, the SM100
# FMHA and DeepGEMM JIT sources (the profile sets VLLM_USE_DEEP_GEMM=0); xgrammar's static library (for C++
# builds, 70 MB); mistral_common's Tekken tokenizers (Mistral models only, 34 MB).
STRIP = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/fmha_sm100",
    "vllm/third_party/deep_gemm",
    "xgrammar/lib/libxgrammar.a",
    "mistral_common/data/tekken_240718.json",
    "mistral_common/data/tekken_240911.json",
)


def image_packages() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for line in (HERE / "image-packages.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version or None
    return out


def pip_download(specs: list[str], dest: Path) -> None:
    if not specs:
        return
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *plat,
            "-d",
            str(dest),
            *specs,
        ],
        check=True,
    )


def wheels(dest: Path) -> dict[str, Path]:
    """{canonical name: wheel}: the pinned version, else the newest where the cache holds several."""
    found: dict[str, tuple[Version, Path]] = {}
    for w in dest.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(w.name)
        if name in PINS and version != Version(PINS[name]):
            continue
        if name not in found or version > found[name][0]:
            found[name] = (version, w)
    return {n: p for n, (_, p) in found.items()}


def requirements(wheel: Path, extras: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(z.read(meta).decode())
    out = []
    for text in message.get_all("Requires-Dist") or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate(TARGET_ENV | {"extra": e}) for e in extras | {""}):
            out.append(req)
    return out


def resolve(dest: Path, image: dict[str, str | None]) -> tuple[dict[str, Path], list[str]]:
    """Download vLLM and, round by round, every requirement neither carried nor in the image; (wheels, problems)."""
    pip_download([f"vllm=={VLLM}", *GPUFLEET], dest)
    extras: dict[str, set[str]] = {}
    changed = True
    while changed:
        have = wheels(dest)
        wanted: dict[str, list[str]] = {}
        changed = False
        for name, wheel in list(have.items()):
            for req in requirements(wheel, extras.get(name, set())):
                dep = canonicalize_name(req.name)
                if dep in NOT_CARRIED or (dep in image and dep not in have):
                    continue
                if not set(req.extras) <= extras.get(dep, set()):
                    extras.setdefault(dep, set()).update(req.extras)
                    changed = True  # the extra's requirements are read next round
                if dep not in have:
                    wanted.setdefault(dep, []).append(str(req.specifier))
        if wanted:
            pip_download(
                [
                    f"{d}=={PINS[d]}" if d in PINS else d + ",".join(s for s in specs if s)
                    for d, specs in wanted.items()
                ],
                dest,
            )
            changed = True
    have = wheels(dest)
    problems = []
    for name, wheel in have.items():
        for req in requirements(wheel, extras.get(name, set())):
            dep = canonicalize_name(req.name)
            if dep in NOT_CARRIED:
                continue
            if dep in have:
                version = parse_wheel_filename(have[dep].name)[1]
                if not req.specifier.contains(version, prereleases=True):
                    problems.append(f"{name} needs {req}, carried {dep} {version}")
            elif dep not in image:
                problems.append(f"{name} needs {req}: neither carried nor in the image")
            elif image[dep] and not req.specifier.contains(image[dep], prereleases=True):
                problems.append(f"{name} needs {req}; the image has {dep} {image[dep]} (kept: it is the machine's)")
    return have, problems


def install(have: dict[str, Path], site: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--no-index",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *(a for p in PLATFORMS for a in ("--platform", p)),
            "--target",
            str(site),
            *map(str, have.values()),
        ],
        check=True,
    )
    for path in STRIP:
        target = site / path
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    for cache in site.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    # Debug info loads nowhere: xgrammar's bindings carry 52 MB of it (9 MB of the xz payload).
    for lib in site.rglob("*.so*"):
        sections = subprocess.run(["readelf", "-S", "-W", str(lib)], capture_output=True, text=True).stdout
        if ".debug_info" in sections:
            subprocess.run(["strip", "--strip-debug", str(lib)], check=True)


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def compress(tar: Path, out: Path, zstd: bool) -> dict[str, dict[str, float]]:
    """xz -9 (the machine has xz) and, to compare, zstd -9 (it has no zstd binary) on the same tar: sizes and
    times."""
    sizes = {}
    for name, argv, suffix in (
        ("xz -9", ["xz", "-9", "-T2", "-k", "-c"], ".xz"),
        ("zstd -9", ["zstd", "-9", "-T2", "-q", "-c"], ".zst"),
    ):
        if shutil.which(argv[0]) is None or (suffix == ".zst" and not zstd):
            continue
        started = time.monotonic()
        with open(out / (tar.name + suffix), "wb") as f:
            subprocess.run([*argv, str(tar)], stdout=f, check=True)
        sizes[name] = {
            "bytes": (out / (tar.name + suffix)).stat().st_size,
            "seconds": round(time.monotonic() - started, 1),
        }
    return sizes


def split(packed: Path, out: Path, piece_bytes: int) -> list[dict[str, object]]:
    pieces = []
    with open(packed, "rb") as f:
        for i in range(1, 100):
            chunk = f.read(piece_bytes)
            if not chunk:
                break
            folder = out / f"p{i}"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{packed.name}.{i:02d}"
            path.write_bytes(chunk)
            pieces.append(
                {"path": str(path.relative_to(out)), "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()}
            )
    return pieces


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="an ignored folder of the checkout the device call sends")
    parser.add_argument("--cache", type=Path, default=Path("/var/cache/gpufleet/gpu-wheels"))
    parser.add_argument("--piece-mib", type=int, default=55, help="each piece travels beside the repo (64 MiB a call)")
    parser.add_argument("--no-zstd", action="store_true", help="skip the zstd comparison")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    have, problems = resolve(args.cache, image_packages())
    missing = [p for p in problems if "kept: it is the machine's" not in p]
    if missing:
        print("\n".join(missing), file=sys.stderr)
        return 1
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=args.cache.parent) as tmp:
        site = Path(tmp) / "site"
        install(have, site)
        tar = Path(tmp) / "payload.tar"
        subprocess.run(
            ["tar", "-C", tmp, "--sort=name", "--owner=0", "--group=0", "--numeric-owner", "-cf", str(tar), "site"],
            check=True,
        )
        compared = compress(tar, Path(tmp), zstd=not args.no_zstd)
        packed = Path(tmp) / "payload.tar.xz"
        digest = hashlib.sha256(packed.read_bytes()).hexdigest()
        pieces = split(packed, args.out, args.piece_mib << 20)
        manifest = {
            "vllm": VLLM,
            "python": "3.12",
            "platforms": PLATFORMS,
            "wheels": {n: p.name for n, p in sorted(have.items())},
            "not_carried": NOT_CARRIED,
            "stripped": STRIP,
            "pins": PINS,
            "image_version_notes": [p for p in problems if p not in missing],
            "installed_bytes": size(site),
            "tar_bytes": tar.stat().st_size,
            "compression": compared,
            "payload": {"name": packed.name, "bytes": packed.stat().st_size, "sha256": digest},
            "pieces": pieces,
        }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    sums = f"{digest}  payload.tar.xz\n" + "".join(f"{p['sha256']}  {Path(str(p['path'])).name}\n" for p in pieces)
    for where in (args.out, args.out / "p1"):  # p1 travels first: the machine checks every later piece against it
        (where / "SHA256SUMS").write_text(sums)
    print(json.dumps({k: manifest[k] for k in ("installed_bytes", "tar_bytes", "compression", "payload")}, indent=1))
    print("\n".join(f"{p['path']}: {p['bytes'] / 2**20:.1f} MiB" for p in pieces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
