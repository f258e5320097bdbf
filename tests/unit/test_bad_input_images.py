"""Image references as docker reports them: `docker.io/` and `library/` are normalised away, and a digest in
`repo:tag@sha256:...` is matched against the local images by digest, so a converge neither fails nor re-pulls."""

from __future__ import annotations

import pytest

from gpufleet.hoststate.ledger import Committed, Ledger, Version
from gpufleet.hoststate.sections import MARK
from gpufleet.image_names import normalise, parse, repository
from gpufleet.vllm.facts import parse_snapshot
from gpufleet.vllm.operations.image import image_present, pick_digest, pinned_ref
from gpufleet.vllm.settings import build_spec

D1, D2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
# `docker images --digests --no-trunc --format '{{.Repository}}|{{.Tag}}|{{.Digest}}'` as docker prints it after
# `docker pull docker.io/vllm/vllm-openai:nightly`, a pull by digest only, `docker pull docker.io/library/ubuntu:24.04`,
# a pull from a local registry and a locally built image (no registry digest).
DOCKER_IMAGES = [
    f"vllm/vllm-openai|nightly|{D1}",
    f"vllm/vllm-openai|<none>|{D2}",
    f"ubuntu|24.04|{D1}",
    f"10.213.1.1:5000/vllm/vllm-openai|nightly|{D2}",
    "gpufleet/standin|latest|<none>",
]


def local_images() -> list[tuple[str, str, str]]:
    lines = ["", MARK + "images", *DOCKER_IMAGES, "", MARK + "end"]
    return parse_snapshot(lines).images


@pytest.mark.parametrize(
    ("written", "short"),
    [
        ("docker.io/vllm/vllm-openai:nightly", "vllm/vllm-openai:nightly"),
        ("index.docker.io/vllm/vllm-openai:nightly", "vllm/vllm-openai:nightly"),
        ("docker.io/library/ubuntu:24.04", "ubuntu:24.04"),
        ("library/ubuntu", "ubuntu"),
        ("docker.io/ubuntu", "ubuntu"),
        ("vllm/vllm-openai:nightly@" + D1, "vllm/vllm-openai:nightly@" + D1),
        ("10.213.1.1:5000/library/ubuntu:24.04", "10.213.1.1:5000/library/ubuntu:24.04"),  # only Docker Hub's
        ("localhost/vllm:dev", "localhost/vllm:dev"),
        ("ghcr.io/org/library/img:1", "ghcr.io/org/library/img:1"),
    ],
)
def test_normalise_like_docker(written, short):
    assert normalise(written) == short


@pytest.mark.parametrize(
    ("written", "present"),
    [
        ("vllm/vllm-openai@" + D1, True),
        ("docker.io/vllm/vllm-openai@" + D1, True),
        ("vllm/vllm-openai:nightly@" + D2, True),  # tag and digest: the digest decides, the tag is ignored
        ("docker.io/vllm/vllm-openai:latest@" + D2, True),
        ("docker.io/library/ubuntu:24.04@" + D1, True),
        ("ubuntu@" + D2, False),
        ("10.213.1.1:5000/vllm/vllm-openai@" + D2, True),
        ("10.213.1.1:5000/vllm/vllm-openai@" + D1, False),  # the same digest from another registry is another image
        ("gpufleet/standin:latest", False),  # no digest to match
    ],
)
def test_a_pinned_reference_matches_the_local_image_by_digest(written, present):
    ref = pinned_ref(None, written)
    assert (ref is not None and image_present(local_images(), ref)) is present


def test_the_pin_of_a_tag_and_digest_is_the_digest():
    assert pinned_ref(None, "docker.io/vllm/vllm-openai:nightly@" + D1) == "vllm/vllm-openai@" + D1
    ledger = Ledger(
        committed=Committed(
            Version("docker.io/vllm/vllm-openai:nightly", "vllm/vllm-openai@" + D2, None, None, None, None), "t0"
        )
    )
    assert pinned_ref(ledger, "docker.io/vllm/vllm-openai:nightly") == "vllm/vllm-openai@" + D2


def test_repo_digests_of_a_docker_io_pull_are_found():
    # `docker image inspect --format '{{json .RepoDigests}}' docker.io/vllm/vllm-openai:nightly` lists short names.
    repo_digests = ["vllm/vllm-openai@" + D1]
    assert pick_digest("docker.io/vllm/vllm-openai:nightly", repo_digests) == "vllm/vllm-openai@" + D1
    assert pick_digest("docker.io/library/ubuntu:24.04", ["ubuntu@" + D2]) == "ubuntu@" + D2
    assert pick_digest("docker.io/vllm/other:nightly", repo_digests) is None
    assert repository("docker.io/library/ubuntu:24.04") == "ubuntu"


@pytest.mark.parametrize(
    "image",
    [
        "docker.io/vllm/vllm-openai:nightly",
        "vllm/vllm-openai:nightly@" + D1,
        "localhost:5000/vllm/vllm-openai",
        "reg.local/a/b/c:v1.2-rc_3",
    ],
)
def test_valid_references_are_accepted_as_written(image):
    assert build_spec("box", {"vllm_image": image}).image == image
    assert parse(image) is not None
