"""The stand-in hub, driven by the real huggingface_hub: what `hf download` and the model check read from it (model
info with the LFS sha256, revision to commit, the tree, resolve's headers, byte ranges, the hub's 404s)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

huggingface_hub = pytest.importorskip("huggingface_hub")
from huggingface_hub import HfApi, HfFileSystem, hf_hub_download, snapshot_download  # noqa: E402
from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError  # noqa: E402

from gpufleet.sandbox import hub as standin  # noqa: E402
from gpufleet.sandbox.image import MODEL_REPO, write_tiny_model  # noqa: E402

SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path, Path, str]]:
    """(endpoint, hub root, its log, the first commit) of a hub serving the tiny model plus a 3 MiB shard."""
    model = tmp_path / "tiny"
    write_tiny_model(model)
    files: dict[str, bytes | Path] = {p.name: p for p in model.iterdir()}
    files[SHARD] = os.urandom(3 << 20)
    root, log = tmp_path / "hub", tmp_path / "hub.log"
    commit = standin.publish(root, MODEL_REPO, files)
    httpd = standin.server(root, "127.0.0.1", 0, log)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", root, log, commit
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_model_info_lists_each_file_with_the_hubs_hashes(served):
    endpoint, root, _, commit = served
    info = HfApi(endpoint=endpoint).model_info(MODEL_REPO, files_metadata=True)
    assert info.sha == commit
    by_name = {s.rfilename: s for s in info.siblings or []}
    shard = (root / MODEL_REPO / "commits" / commit / SHARD).read_bytes()
    assert by_name[SHARD].lfs is not None and by_name[SHARD].lfs.sha256 == hashlib.sha256(shard).hexdigest()
    assert by_name[SHARD].size == len(shard)
    config = (root / MODEL_REPO / "commits" / commit / "config.json").read_bytes()
    assert by_name["config.json"].lfs is None
    assert by_name["config.json"].blob_id == standin.git_blob_id(config)  # what `git hash-object` prints


def test_snapshot_download_then_the_clients_own_checksum_check(served, tmp_path: Path):
    endpoint, root, log, commit = served
    dest = tmp_path / "dl"
    began = time.time()
    snapshot_download(MODEL_REPO, local_dir=dest, endpoint=endpoint)
    for f in (root / MODEL_REPO / "commits" / commit).iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes()
    result = HfApi(endpoint=endpoint).verify_repo_checksums(MODEL_REPO, revision=commit, local_dir=dest)
    ended = time.time()
    assert result.checked_count == 6 and not result.mismatches and not result.missing_paths
    total = sum(f.stat().st_size for f in (root / MODEL_REPO / "commits" / commit).iterdir())
    assert standin.served_bytes(log) == {"127.0.0.1": total}
    # Each request is logged with when it ended: what a test holds against a host's downtime.
    logged = standin.requests(log)
    assert {r.path for r in logged if r.download} == {
        f"/{MODEL_REPO}/resolve/{commit}/{f.name}" for f in (root / MODEL_REPO / "commits" / commit).iterdir()
    }
    assert all(began <= r.ended_at <= ended for r in logged), (began, ended, logged)


def test_a_byte_range_is_served_alone(served):
    """huggingface_hub's file system reads a slice with a Range request: the hub serves those bytes (206), no more."""
    endpoint, root, log, commit = served
    shard = (root / MODEL_REPO / "commits" / commit / SHARD).read_bytes()
    fs = HfFileSystem(endpoint=endpoint)
    with fs.open(f"{MODEL_REPO}/{SHARD}", "rb", revision=commit, block_size=5000, cache_type="none") as f:
        f.seek(1000)
        assert f.read(5000) == shard[1000:6000]
    assert f"GET /{MODEL_REPO}/resolve/{commit}/{SHARD} 206 5000" in log.read_text()


def test_a_moved_branch_resolves_to_its_new_commit_and_the_old_commit_stays(served):
    endpoint, root, _, first = served
    second = standin.publish(root, MODEL_REPO, {"config.json": b"{}\n", "model.safetensors": b"x" * 100})
    api = HfApi(endpoint=endpoint)
    assert second != first
    assert api.model_info(MODEL_REPO).sha == second
    assert api.model_info(MODEL_REPO, revision=first).sha == first
    assert sorted(s.rfilename for s in api.model_info(MODEL_REPO, revision=second).siblings or []) == [
        "config.json",
        "model.safetensors",
    ]


def test_unknown_repo_revision_and_file_raise_the_clients_errors(served, tmp_path: Path):
    endpoint, *_ = served
    api = HfApi(endpoint=endpoint)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("nobody/nothing")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(MODEL_REPO, revision="v9")
    with pytest.raises(huggingface_hub.errors.EntryNotFoundError):
        hf_hub_download(MODEL_REPO, "absent.json", local_dir=tmp_path / "x", endpoint=endpoint)
