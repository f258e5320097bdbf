"""The image's stand-in `hf download`: fetches the bundled model, skips complete files, resumes partial ones,
fails clearly for an unknown repo or revision."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.sandbox import image

HF = Path(image.__file__).parent / "standin" / "hf.py"


@pytest.fixture
def hub(tmp_path: Path) -> Path:
    image.write_tiny_model(tmp_path / "hub" / image.MODEL_REPO)
    return tmp_path / "hub"


def hf(hub: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(HF), *args], capture_output=True, text=True, env={**os.environ, "STANDIN_HUB": str(hub)}
    )


def test_download_then_skip_and_resume(hub: Path, tmp_path: Path):
    dest = tmp_path / "models" / "tiny"
    first = hf(hub, "download", image.MODEL_REPO, "--local-dir", str(dest))
    assert first.returncode == 0 and first.stdout.strip() == str(dest)
    assert "Fetching 5 files: 100%" in first.stderr
    src = hub / image.MODEL_REPO
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (dest / f).read_bytes() == (src / f).read_bytes()
    assert (dest / ".cache/huggingface/download/config.json.metadata").exists()

    weights = dest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # an interrupted download
    again = hf(hub, "download", image.MODEL_REPO, "--local-dir", str(dest), "--revision", "main")
    assert again.returncode == 0
    assert "config.json: already complete, skipped" in again.stderr
    assert "model.safetensors: resuming at 100 bytes" in again.stderr
    assert weights.read_bytes() == (src / "model.safetensors").read_bytes()


def test_bundled_model_is_structurally_valid(hub: Path):
    d = hub / image.MODEL_REPO
    assert json.loads((d / "config.json").read_text())["max_position_embeddings"] == 262144
    raw = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    start, end = header["model.embed_tokens.weight"]["data_offsets"]
    assert end - start == 256 * 8 * 2 == len(raw) - 8 - n


@pytest.mark.parametrize(
    "args, message",
    [
        (["no-such/repo"], "Repository Not Found for url: https://huggingface.co/api/models/no-such/repo/revision/main."),
        ([image.MODEL_REPO, "--revision", "v9"], "Revision Not Found"),
    ],
)
def test_unknown_repo_or_revision_fails(hub: Path, tmp_path: Path, args, message):
    out = hf(hub, "download", *args, "--local-dir", str(tmp_path / "x"))
    assert out.returncode == 1 and message in out.stderr and out.stdout == ""
