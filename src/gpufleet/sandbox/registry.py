"""The fleet registry's API for tests and benches: move a tag as a new nightly does, and push stand-in nightlies."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

from gpufleet.sandbox import cache, procs
from gpufleet.sandbox.config import FleetConfig
from gpufleet.sandbox.image import REPOSITORY, image_ref

# `good` plus one incompressible layer each, seeded by the tag, so what a pull moves is measurable (docs/test-hosts.md).
NIGHTLY_LAYER_BYTES = 100 * 1024 * 1024
NIGHTLIES = {"nightly-1": "0.32.1.dev41+gstandin", "nightly-2": "0.32.1.dev42+gstandin"}
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def nightly_layer(cache_dir: Path, tag: str, size: int = NIGHTLY_LAYER_BYTES) -> tuple[Path, str]:
    """(the gzipped layer file, its diff id), built once per tag and size."""
    out = cache_dir / f"nightly-layer-{tag}-{size}.tar.gz"
    diff_file = out.with_name(out.name + ".diffid")
    if out.exists() and diff_file.exists():
        return out, diff_file.read_text()
    with cache.building(cache_dir / f".nightly-layer-{tag}-{size}.lock"):
        if not (out.exists() and diff_file.exists()):
            data = random.Random(f"gpufleet-nightly-{tag}").randbytes(size)  # reproducible, not secret
            raw = io.BytesIO()
            with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                info = tarfile.TarInfo(f"opt/nightly/{tag}.bin")
                info.size, info.mode, info.mtime = size, 0o644, 0
                tar.addfile(info, io.BytesIO(data))
            tmp = out.with_name(out.name + ".tmp")
            with open(tmp, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", compresslevel=1, mtime=0) as gz:
                gz.write(raw.getvalue())
            diff_file.write_text("sha256:" + hashlib.sha256(raw.getvalue()).hexdigest())
            tmp.rename(out)
    return out, diff_file.read_text()


def registry_request(
    cfg: FleetConfig, path: str, data: bytes | None = None, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request to the fleet's registry API, errors included."""
    request = urllib.request.Request(f"http://{cfg.registry}{path}", data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# Every manifest type the fleet registry may hold for a tag.
ANY_MANIFEST = ", ".join(
    (
        MANIFEST_TYPE,
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    )
)


def tag_manifest(registry: str, tag: str) -> tuple[bytes, str, str]:
    """(body, content type, digest) of a tag's manifest in the registry at "host:port"."""
    req = urllib.request.Request(f"http://{registry}/v2/{REPOSITORY}/manifests/{tag}", headers={"Accept": ANY_MANIFEST})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read(), r.headers["Content-Type"], r.headers["Docker-Content-Digest"]


def move_tag(registry: str, tag: str, to: str) -> str:
    """Point `tag` at another tag's manifest, as a new nightly moves upstream; returns the tag's digest ref."""
    body, content_type, digest = tag_manifest(registry, to)
    req = urllib.request.Request(
        f"http://{registry}/v2/{REPOSITORY}/manifests/{tag}",
        data=body,
        method="PUT",
        headers={"Content-Type": content_type},
    )
    urllib.request.urlopen(req, timeout=30).read()
    if tag_manifest(registry, tag)[2] != digest:
        raise procs.SandboxError(f"{registry}: {REPOSITORY}:{tag} does not name {digest} after the push")
    return f"{registry}/{REPOSITORY}@{digest}"


def _push_blob(cfg: FleetConfig, data: bytes | Path) -> tuple[str, int]:
    body = data.read_bytes() if isinstance(data, Path) else data
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    if registry_request(cfg, f"/v2/{REPOSITORY}/blobs/{digest}", method="HEAD")[0] != 200:
        status, headers, _ = registry_request(cfg, f"/v2/{REPOSITORY}/blobs/uploads/", data=b"", method="POST")
        location = headers["Location"]
        location = location if location.startswith("/") else "/" + location.split("/", 3)[3]
        sep = "&" if "?" in location else "?"
        status, _, text = registry_request(
            cfg,
            f"{location}{sep}digest={digest}",
            data=body,
            method="PUT",
            headers={"Content-Type": "application/octet-stream"},
        )
        if status != 201:
            raise procs.SandboxError(f"pushing a blob to {cfg.registry} failed: HTTP {status} {text[:200]!r}")
    return digest, len(body)


def nightly_ref(cfg: FleetConfig, tag: str) -> str:
    """The digest reference of a stand-in nightly that ensure_nightlies pushed."""
    status, headers, _ = registry_request(
        cfg, f"/v2/{REPOSITORY}/manifests/{tag}", method="HEAD", headers={"Accept": MANIFEST_TYPE}
    )
    if status != 200:
        raise procs.SandboxError(f"{image_ref(cfg, tag)} is not in the registry (fix: ensure_nightlies first)")
    return f"{cfg.registry}/{REPOSITORY}@{headers['Docker-Content-Digest']}"


def ensure_nightlies(
    cfg: FleetConfig, tags: tuple[str, ...] = tuple(NIGHTLIES), size: int = NIGHTLY_LAYER_BYTES
) -> dict[str, str]:
    """Push each stand-in nightly through the registry's HTTP API unless there; tag -> its digest reference."""
    refs = {}
    good = json.loads(registry_request(cfg, f"/v2/{REPOSITORY}/manifests/good", headers={"Accept": MANIFEST_TYPE})[2])
    for tag in tags:
        status, _, body = registry_request(cfg, f"/v2/{REPOSITORY}/manifests/{tag}", headers={"Accept": MANIFEST_TYPE})
        # The registry outlives a change of the stand-in image; a nightly on an older `good` would share no layer.
        current = status == 200 and [d["digest"] for d in json.loads(body)["layers"][:-1]] == [
            d["digest"] for d in good["layers"]
        ]
        if not current:
            manifest = json.loads(json.dumps(good))
            config = json.loads(registry_request(cfg, f"/v2/{REPOSITORY}/blobs/{manifest['config']['digest']}")[2])
            layer, diff_id = nightly_layer(cfg.cache_dir, tag, size)
            layer_digest, layer_size = _push_blob(cfg, layer)
            config["rootfs"]["diff_ids"].append(diff_id)
            config.setdefault("history", []).append({"created_by": f"gpufleet stand-in nightly {tag}"})
            env = [e for e in config["config"]["Env"] if not e.startswith("STANDIN_VLLM_VERSION=")]
            config["config"]["Env"] = [*env, f"STANDIN_VLLM_VERSION={NIGHTLIES.get(tag, '0.32.1.dev49+gstandin')}"]
            config["config"].setdefault("Labels", {})["org.gpufleet.standin"] = tag
            config_digest, config_size = _push_blob(cfg, json.dumps(config, sort_keys=True).encode())
            manifest["config"] = {**manifest["config"], "digest": config_digest, "size": config_size}
            manifest["layers"] = [
                *manifest["layers"],
                {"mediaType": _LAYER, "size": layer_size, "digest": layer_digest},
            ]
            status, _, text = registry_request(
                cfg,
                f"/v2/{REPOSITORY}/manifests/{tag}",
                method="PUT",
                data=json.dumps(manifest, indent=3).encode(),
                headers={"Content-Type": MANIFEST_TYPE},
            )
            if status != 201:
                raise procs.SandboxError(f"pushing {image_ref(cfg, tag)} failed: HTTP {status} {text[:200]!r}")
        refs[tag] = nightly_ref(cfg, tag)
    return refs
