"""Pure helpers behind the operations: image pinning records, key dearmoring, env file, model completeness."""

from __future__ import annotations

import base64

import pytest
from pyinfra.api import OperationValueError

from gpufleet.hoststate.ledger import Committed, Ledger, Version
from gpufleet.image_names import repository
from gpufleet.operations.secret import Hidden
from gpufleet.vllm.facts import HostSnapshot
from gpufleet.vllm.operations.docker import repo_line
from gpufleet.vllm.operations.image import pick_digest, pinned_ref
from gpufleet.vllm.operations.model import missing_parts
from gpufleet.vllm.operations.nvidia import list_line
from gpufleet.vllm.operations.repo_keys import dearmor
from gpufleet.vllm.operations.service import env_content

D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


@pytest.mark.parametrize(
    ("image", "repo"),
    [
        ("vllm/vllm-openai:nightly", "vllm/vllm-openai"),
        ("10.213.1.1:5000/vllm/vllm-openai:nightly", "10.213.1.1:5000/vllm/vllm-openai"),
        ("10.213.1.1:5000/vllm/vllm-openai", "10.213.1.1:5000/vllm/vllm-openai"),
        ("vllm/vllm-openai@" + D1, "vllm/vllm-openai"),
    ],
)
def test_repository_keeps_registry_port(image, repo):
    assert repository(image) == repo


def test_pick_digest_matches_the_repository():
    digests = ["other/img@" + D2, "reg:5000/vllm/vllm-openai@" + D1]
    assert pick_digest("reg:5000/vllm/vllm-openai:nightly", digests) == "reg:5000/vllm/vllm-openai@" + D1
    assert pick_digest("vllm/vllm-openai:nightly", digests) is None


def test_pin_is_reused_only_for_the_same_image_setting():
    version = Version(image="v:nightly", ref="v@" + D1, unit_sha256=None, spec_hash=None, service="v", port=1)
    ledger = Ledger(committed=Committed(version, "t1"))
    assert pinned_ref(ledger, "v:nightly") == "v@" + D1
    assert pinned_ref(ledger, "v:latest") is None  # a new image setting resolves again
    assert pinned_ref(None, "v@" + D2) == "v@" + D2  # a digest given by the user is its own pin
    # gpufleet_image_ref (what a rollout installs) wins over the ledger's pin and the tag.
    assert pinned_ref(ledger, "v:nightly", "v@" + D2) == "v@" + D2


def test_dearmor_equals_the_base64_body():
    body = bytes(range(256)) * 3
    b64 = base64.b64encode(body).decode()
    armored = (
        "-----BEGIN PGP PUBLIC KEY BLOCK-----\nComment: x\n\n"
        + "\n".join(b64[i : i + 64] for i in range(0, len(b64), 64))
        + "\n=abcd\n-----END PGP PUBLIC KEY BLOCK-----\n"
    )
    assert dearmor(armored) == body
    with pytest.raises(ValueError, match=r"^not an ASCII-armored PGP public key block$"):
        dearmor("<html>not found</html>")


def test_repo_lines():
    assert list_line("http://r/nv/") == (
        "deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] http://r/nv/stable/deb/$(ARCH) /\n"
    )
    assert repo_line("https://download.docker.com/linux", "ubuntu", "noble", "amd64") == (
        "deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc] https://download.docker.com/linux/ubuntu noble stable\n"
    )


def test_env_content_skips_unset_and_rejects_unsafe_values_without_echoing_them():
    text = env_content({"VLLM_API_KEY": "sk-abc.123", "HF_TOKEN": None})
    assert text.endswith("VLLM_API_KEY=sk-abc.123\n") and "HF_TOKEN" not in text
    with pytest.raises(OperationValueError) as error:
        env_content({"VLLM_API_KEY": "a b$c"})
    assert "a b$c" not in str(error.value)


def test_hidden_never_shows_its_value():
    secret = Hidden("hf_topsecret")
    assert "topsecret" not in repr(secret) and "topsecret" not in str(secret) and "topsecret" not in repr([secret])
    assert secret.reveal() == "hf_topsecret"


@pytest.mark.parametrize(
    ("files", "shards", "incomplete", "problem"),
    [
        ({"config.json": 1, "tokenizer.json": 1, "model.safetensors": 5}, [], [], None),
        ({"tokenizer.json": 1, "model.safetensors": 5}, [], [], "config.json"),
        ({"config.json": 1, "model.safetensors": 5}, [], [], "a tokenizer"),
        ({"config.json": 1, "tokenizer.model": 1}, [], [], "weights"),
        (
            {"config.json": 1, "tokenizer.json": 1, "a.safetensors": 5},
            ["a.safetensors", "b.safetensors"],
            [],
            "1 of 2 shards",
        ),
        ({"config.json": 1, "tokenizer.json": 1, "a.safetensors": 0}, [], [], "0 bytes"),
        ({"config.json": 1, "tokenizer.json": 1, "a.safetensors": 5}, [], ["./x.incomplete"], "unfinished download"),
    ],
)
def test_model_completeness(files, shards, incomplete, problem):
    missing = missing_parts(HostSnapshot(model_files=files, model_shards=shards, model_incomplete=incomplete))
    if problem is None:
        assert missing == []
    else:
        assert any(problem in m for m in missing), missing
