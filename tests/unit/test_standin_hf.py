"""The image's stand-in `hf download` against the stand-in hub: the files land as the real CLI lands them, a file
recorded complete is skipped without a byte fetched, a partial one is resumed, a file on Xet needs
HF_HUB_DISABLE_XET=1, and an unknown repo or revision fails with the real CLI's message."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.sandbox import hub as standin
from gpufleet.sandbox import image

HF = Path(image.__file__).parent / "standin" / "hf.py"
SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[str, Path, Path, str]]:
    """(endpoint, root, log, commit) of a stand-in hub serving the tiny model and a 2 MiB shard."""
    model = tmp_path / "tiny"
    image.write_tiny_model(model)
    files: dict[str, bytes | Path] = {p.name: p for p in model.iterdir()}
    files[SHARD] = os.urandom(2 << 20)
    root, log = tmp_path / "hub", tmp_path / "hub.log"
    commit = standin.publish(root, image.MODEL_REPO, files)
    httpd = standin.server(root, "127.0.0.1", 0, log)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", root, log, commit
    finally:
        httpd.shutdown()
        httpd.server_close()


def hf(endpoint: str, *args: str, xet_off: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": endpoint}
    env.pop("HF_HUB_DISABLE_XET", None)
    if xet_off:
        env["HF_HUB_DISABLE_XET"] = "1"
    return subprocess.run([sys.executable, str(HF), *args], capture_output=True, text=True, env=env)


def test_download_then_skip_then_resume(hub, tmp_path: Path):
    endpoint, root, log, commit = hub
    dest = tmp_path / "models" / "tiny"
    first = hf(endpoint, "download", image.MODEL_REPO, "--local-dir", str(dest))
    assert first.returncode == 0 and first.stdout.strip() == str(dest)
    assert "Fetching 6 files: 100%" in first.stderr
    src = root / image.MODEL_REPO / "commits" / commit
    for f in src.iterdir():
        assert (dest / f.name).read_bytes() == f.read_bytes()
    assert (dest / ".cache/huggingface/download/config.json.metadata").read_text().startswith(commit + "\n")
    served = sum(f.stat().st_size for f in src.iterdir())
    assert standin.served_bytes(log) == {"127.0.0.1": served}

    offset = log.stat().st_size
    again = hf(endpoint, "download", image.MODEL_REPO, "--local-dir", str(dest), "--revision", "main")
    assert again.returncode == 0 and "config.json: already complete, skipped" in again.stderr
    assert standin.served_bytes(log, offset) == {}

    # an interrupted download: hf's partial file, named after the file and its etag
    shard = (src / SHARD).read_bytes()
    etag = standin.describe(SHARD, shard).etag()
    (dest / SHARD).unlink()
    (dest / f".cache/huggingface/download/{SHARD}.metadata").unlink()
    (dest / f".cache/huggingface/download/{SHARD}.{etag}.incomplete").write_bytes(shard[:1000])
    offset = log.stat().st_size
    resumed = hf(endpoint, "download", image.MODEL_REPO, "--local-dir", str(dest), "--revision", commit)
    assert resumed.returncode == 0 and f"{SHARD}: resuming at 1000 bytes" in resumed.stderr
    assert (dest / SHARD).read_bytes() == shard
    assert standin.served_bytes(log, offset) == {"127.0.0.1": len(shard) - 1000}


def test_a_file_on_xet_needs_xet_turned_off(tmp_path: Path):
    model = tmp_path / "tiny"
    image.write_tiny_model(model)
    root = tmp_path / "hub"
    standin.publish(root, image.MODEL_REPO, {p.name: p for p in model.iterdir()})
    httpd = standin.server(root, "127.0.0.1", 0, xet=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"
        on = hf(endpoint, "download", image.MODEL_REPO, "--local-dir", str(tmp_path / "a"), xet_off=False)
        assert on.returncode == 1 and "model.safetensors: stored on Xet" in on.stderr
        off = hf(endpoint, "download", image.MODEL_REPO, "--local-dir", str(tmp_path / "b"))
        assert off.returncode == 0 and (tmp_path / "b" / "model.safetensors").exists()
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_unknown_repo_or_revision_fails_with_the_real_message(hub, tmp_path: Path):
    endpoint, *_ = hub
    repo = hf(endpoint, "download", "nobody/nothing", "--local-dir", str(tmp_path / "x"))
    assert repo.returncode == 1 and "Repository Not Found for url" in repo.stderr
    rev = hf(endpoint, "download", image.MODEL_REPO, "--local-dir", str(tmp_path / "x"), "--revision", "v9")
    assert rev.returncode == 1 and "Revision Not Found for url" in rev.stderr and "Invalid rev id: v9" in rev.stderr
