"""The model check (gpufleet.vllm.weights): the hub's listing parsed, and the host's files hashed by the shell it
builds, run here with sh over real files, against what the stand-in hub publishes."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from gpufleet.sandbox import hub
from gpufleet.vllm import weights

REPO = "gpufleet-sandbox/Qwen3.5-tiny"


def revision_of(files: dict[str, bytes]) -> weights.HubRevision:
    siblings = []
    for path, data in files.items():
        f = hub.describe(path, data)
        siblings.append(
            {
                "rfilename": path,
                "size": f.size,
                "blobId": f.blob_id,
                **({"lfs": {"sha256": f.sha256, "size": f.size}} if f.sha256 else {}),
            }
        )
    return weights.parse_info(REPO, json.dumps({"sha": "e" * 40, "siblings": siblings}))


def hashed(model_dir: Path, revision: weights.HubRevision) -> list[str]:
    out = subprocess.run(
        ["sh", "-c", weights.hash_command(str(model_dir), revision.files)], capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


FILES = {"config.json": b'{"a": 1}\n', "model.safetensors": b"\x00" * 4096 + b"weights", "sub/tok.json": b"{}"}


def test_a_faithful_copy_matches_lfs_by_sha256_and_the_rest_by_git_blob_id(tmp_path: Path):
    for path, data in FILES.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    revision = revision_of(FILES)
    assert revision.files[1].sha256 == hashlib.sha256(FILES["model.safetensors"]).hexdigest()
    assert weights.mismatches(revision, hashed(tmp_path, revision)) == []


def test_a_changed_byte_or_a_missing_file_is_named(tmp_path: Path):
    for path, data in FILES.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    (tmp_path / "model.safetensors").write_bytes(b"\x01" + FILES["model.safetensors"][1:])
    (tmp_path / "sub/tok.json").unlink()
    (tmp_path / "config.json").write_bytes(b'{"a": 2}\n')
    revision = revision_of(FILES)
    assert weights.mismatches(revision, hashed(tmp_path, revision)) == [
        "config.json",
        "model.safetensors",
        "sub/tok.json",
    ]


def test_the_hubs_answer_is_refused_without_a_commit_or_hashes():
    with pytest.raises(ValueError, match="names no commit"):
        weights.parse_info(REPO, json.dumps({"sha": "main", "siblings": []}))
    with pytest.raises(ValueError, match="without its name, size or blob id"):
        weights.parse_info(REPO, json.dumps({"sha": "e" * 40, "siblings": [{"rfilename": "a"}]}))
    with pytest.raises(ValueError, match="without its name"):
        weights.parse_info(
            REPO,
            json.dumps({"sha": "e" * 40, "siblings": [{"rfilename": "../etc/passwd", "size": 1, "blobId": "a" * 40}]}),
        )
    with pytest.raises(ValueError, match="not JSON"):
        weights.parse_info(REPO, "<html>")


def test_the_token_comes_from_the_env_file_never_the_command_line(tmp_path: Path):
    env = tmp_path / "env"
    env.write_text("VLLM_API_KEY=k\nHF_TOKEN=hf_secret\n")
    command = weights.fetch_info_command("http://hub/api/models/a/b/revision/main?blobs=true", str(env))
    assert "hf_secret" not in command
    header = subprocess.run(["sh", "-c", weights.token_header_command(str(env))], capture_output=True, text=True)
    assert header.stdout == "Authorization: Bearer hf_secret\n"


OLD, NEW = f"{REPO}@{'a' * 40}", f"{REPO}@{'b' * 40}"


def checked_dir(d: Path, pinned: str, weights_data: bytes) -> None:
    """A model directory as a download leaves it: files, hf's record of each, the mark."""
    (d / ".cache/huggingface/download").mkdir(parents=True)
    (d / "config.json").write_text("{}\n")
    (d / "model.safetensors").write_bytes(weights_data)
    (d / ".cache/huggingface/download/model.safetensors.metadata").write_text(f"{pinned}\n")
    (d / weights.MARKER).write_text(pinned + "\n")


def sh(command: str) -> str:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout


def download_over(d: Path, pinned: str, weights_data: bytes) -> None:
    """What hf and the deploy do to the directory: a file replaced by a rename, hf's record rewritten in place, the
    mark replaced."""
    (d / "model.safetensors.tmp").write_bytes(weights_data)
    (d / "model.safetensors.tmp").rename(d / "model.safetensors")
    with (d / ".cache/huggingface/download/model.safetensors.metadata").open("r+") as record:
        record.write(f"{pinned}\n")
    (d / "mark.tmp").write_text(pinned + "\n")
    (d / "mark.tmp").rename(d / weights.MARKER)


def test_the_committed_files_are_kept_by_links_and_come_back_whole(tmp_path: Path):
    d = tmp_path / "models" / "m"
    checked_dir(d, OLD, b"old weights")
    sh(weights.keep_command(str(d)))
    kept = Path(weights.kept_dir(str(d)))
    assert (kept / "model.safetensors").stat().st_ino == (d / "model.safetensors").stat().st_ino  # no bytes copied
    download_over(d, NEW, b"new weights")
    sh(weights.keep_command(str(d)))  # a second move keeps what was kept first
    assert (kept / "model.safetensors").read_bytes() == b"old weights"
    assert sh(weights.restore_command(str(d), NEW)) == "" and (d / "model.safetensors").read_bytes() == b"new weights"
    assert sh(weights.restore_command(str(d), OLD)).split() == [weights.RESTORED]
    assert (d / "model.safetensors").read_bytes() == b"old weights" and (d / weights.MARKER).read_text() == OLD + "\n"
    # hf's record is the old commit's too: a later download of the new one fetches the file again.
    assert (d / ".cache/huggingface/download/model.safetensors.metadata").read_text() == f"{OLD}\n"
    assert sorted(p.name for p in d.parent.iterdir()) == ["m"]


def test_a_restore_cut_after_its_first_move_is_finished_by_the_next(tmp_path: Path):
    d = tmp_path / "m"
    checked_dir(d, OLD, b"old weights")
    sh(weights.keep_command(str(d)))
    download_over(d, NEW, b"new weights")
    d.rename(tmp_path / "m.gpufleet-old")  # the restore's first step, then the cut
    assert sh(weights.restore_command(str(d), OLD)).split() == [weights.RESTORED]
    assert (d / "model.safetensors").read_bytes() == b"old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_commit_drops_the_kept_copy(tmp_path: Path):
    d = tmp_path / "m"
    checked_dir(d, OLD, b"old weights")
    sh(weights.keep_command(str(d)))
    sh(weights.drop_kept_command(str(d)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
