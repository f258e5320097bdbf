"""gpufleet.rollout.target without test hosts: the registry lookup's commands (run through a real shell against a
`docker` that records its arguments), its parsing of docker's real outputs (tests/fixtures/registry-lookup, recorded
on a sandbox host), its one-line errors, and resolve()'s choices over fake sessions: which tool, which host, and
that nothing is pulled unless no tool can pin the tag."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from gpufleet.errors import GpufleetError
from gpufleet.remote.transport import Unreachable
from gpufleet.rollout import target as t
from gpufleet.rollout.hosts import FleetHost
from gpufleet.vllm.settings import build_spec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "registry-lookup"
REG = "10.213.5.1:5000"
REPO = f"{REG}/vllm/vllm-openai"
TAG = f"{REPO}:nightly"
GOOD = "sha256:5bc523a930a1c59884db1e212e0760003ee87e7e1a90166234f9d88cef5cc1f8"  # the recorded tag's digest
LIST = "sha256:" + "1" * 64
HUB_INFO = {
    "InsecureRegistryCIDRs": ["127.0.0.0/8"],
    "IndexConfigs": {"docker.io": {"Name": "docker.io", "Secure": True, "Official": True}},
}


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def probe_out(*tools: str, config: dict | None = None) -> str:
    return "".join(f"tool={tool}\n" for tool in tools) + f"registry-config={json.dumps(config) if config else ''}\n"


def buildx_out(digest: str, media: str = "application/vnd.oci.image.index.v1+json") -> str:
    """`docker buildx imagetools inspect --format '{{json .Manifest}}'` as buildx's documentation shows it."""
    return (
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": media,
                "digest": digest,
                "size": 1609,
                "manifests": [
                    {
                        "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "digest": "sha256:" + "2" * 64,
                        "size": 2386,
                        "platform": {"architecture": "amd64", "os": "linux"},
                    }
                ],
            },
            indent=2,
        )
        + "\n"
    )


# --- the commands, through a real shell ----------------------------------------------------------------------------
@pytest.fixture
def recording_docker(tmp_path):
    """A `docker` first on PATH that writes its argv, one per line, and answers nothing."""
    log = tmp_path / "argv"
    docker = tmp_path / "bin" / "docker"
    docker.parent.mkdir()
    docker.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {log}\n')
    docker.chmod(docker.stat().st_mode | stat.S_IEXEC)
    return log, {**os.environ, "PATH": f"{docker.parent}:{os.environ['PATH']}"}


@pytest.mark.skipif(shutil.which("timeout") is None, reason="coreutils timeout")
@pytest.mark.parametrize(("tool", "insecure", "argv"), [
    (t.BUILDX, False, ["buildx", "imagetools", "inspect", "--format", "{{json .Manifest}}", "reg:5000/a b;x"]),
    (t.MANIFEST, False, ["manifest", "inspect", "-v", "reg:5000/a b;x"]),
    (t.MANIFEST, True, ["manifest", "inspect", "-v", "--insecure", "reg:5000/a b;x"]),
])  # fmt: skip
def test_lookup_commands_reach_docker_with_these_arguments(recording_docker, tool, insecure, argv):
    log, env = recording_docker
    command = t.lookup_command(tool, "reg:5000/a b;x", insecure)  # quoted: a reference never has these, but still
    assert command.startswith(f"timeout {t.LOOKUP_TIMEOUT_S} docker ")
    subprocess.run(["sh", "-c", command], env=env, check=True, timeout=30)
    assert log.read_text().splitlines() == argv


def test_the_probe_reads_tools_and_registry_settings(recording_docker):
    # The real recording: docker manifest works, buildx does not, the sandbox registry is insecure.
    probe = t.parse_probe(fixture("docker-20.10.24-probe.txt"))
    assert probe.tools == {t.MANIFEST}
    assert probe.registry_config is not None and t.insecure(REG, probe.registry_config)
    assert t.tool_order(probe, TAG) == [t.MANIFEST]
    # Through a shell with a docker that answers nothing and succeeds at everything: both tools, no settings.
    _, env = recording_docker
    out = subprocess.run(["sh", "-c", t.PROBE_COMMAND], env=env, capture_output=True, text=True, check=True).stdout
    assert t.parse_probe(out) == t.Probe(frozenset({t.BUILDX, t.MANIFEST}), None)
    assert t.parse_probe("registry-config=not json\n") == t.Probe(frozenset(), None)


@pytest.mark.parametrize(("image", "registry"), [
    ("vllm/vllm-openai:nightly", "docker.io"), ("ubuntu", "docker.io"), ("docker.io/vllm/vllm-openai:x", "docker.io"),
    (TAG, REG), ("localhost/x:y", "localhost"), ("ghcr.io/org/img:1", "ghcr.io"),
])  # fmt: skip
def test_registry_of_an_image(image, registry):
    assert t.registry_of(image) == registry


def test_insecure_is_what_dockerd_treats_so():
    config = json.loads(fixture("docker-20.10.24-probe.txt").splitlines()[1].partition("=")[2])
    assert t.insecure(REG, config)  # insecure-registries
    assert not t.insecure("docker.io", config)
    assert t.insecure("127.0.0.1:5000", config) and t.insecure("localhost:5000", config)  # the default CIDR
    assert not t.insecure("10.0.0.9:5000", config) and not t.insecure("reg.example:5000", config)
    assert t.insecure("[::1]:5000", {"InsecureRegistryCIDRs": ["::1/128"]})
    assert not t.insecure(REG, None) and not t.insecure(REG, {"InsecureRegistryCIDRs": ["not a cidr"]})


def test_buildx_is_asked_first_except_for_an_insecure_registry():
    both = frozenset({t.BUILDX, t.MANIFEST})
    assert t.tool_order(t.Probe(both, HUB_INFO), "vllm/vllm-openai:nightly") == [t.BUILDX, t.MANIFEST]
    insecure = {"IndexConfigs": {REG: {"Secure": False}}}
    assert t.tool_order(t.Probe(both, insecure), TAG) == [t.MANIFEST, t.BUILDX]
    assert t.tool_order(t.Probe(frozenset(), insecure), TAG) == []


# --- the outputs -------------------------------------------------------------------------------------------------
def test_the_digest_of_a_manifest_from_docker_manifest_inspect_recorded():
    assert t.digest_from_lookup(t.MANIFEST, fixture("docker-20.10.24-manifest-inspect-v-single.json")) == GOOD


def test_docker_manifest_inspect_of_a_list_cannot_pin_it_recorded():
    out = fixture("docker-20.10.24-manifest-inspect-v-list.json")
    # Only the platform's manifest is there (the list's own digest, 3b3fac2a..., is not): never pin that one.
    assert GOOD in out and "3b3fac2a" not in out
    with pytest.raises(t.MultiPlatform, match=r"a multi-platform list \(1 platform\)"):
        t.digest_from_lookup(t.MANIFEST, out)


def test_the_digest_buildx_prints_is_the_lists_own():
    assert t.digest_from_lookup(t.BUILDX, buildx_out(LIST)) == LIST
    one = buildx_out(GOOD, "application/vnd.docker.distribution.manifest.v2+json")
    assert t.digest_from_lookup(t.BUILDX, one) == GOOD


@pytest.mark.parametrize(("tool", "out"), [
    (t.BUILDX, "Name: x\nDigest: sha256:abc\n"), (t.BUILDX, '{"digest": "sha256:short"}'), (t.BUILDX, "[]"),
    (t.MANIFEST, '{"Descriptor": {}}'), (t.MANIFEST, ""),
])  # fmt: skip
def test_output_that_is_not_understood_is_a_value_error(tool, out):
    with pytest.raises(ValueError, match=r"^(no digest in .+'s output: |Expecting value)"):  # or not JSON at all
        t.digest_from_lookup(tool, out)


@pytest.mark.parametrize(("rc", "err", "said", "fix"), [
    (1, fixture("docker-20.10.24-manifest-inspect-unknown-tag.stderr"), f"no such manifest: {REPO}:no-such-tag",
     f"check that the tag exists in {REG}"),
    (1, fixture("docker-20.10.24-manifest-inspect-unreachable.stderr"), "connect: connection refused",
     f"check that h1 reaches {REG}"),
    # The CLI's words for a refused login (and Docker Hub's for a repository that does not exist): not recorded.
    (1, "errors:\ndenied: requested access to the resource is denied\nunauthorized: authentication required\n",
     "denied: requested access to the resource is denied unauthorized: authentication required",
     f"the registry refused the lookup: log in as root on h1 (`docker login {REG}`"),
    (124, "", "no answer within 120 s", f"check that h1 reaches {REG}"),
])  # fmt: skip
def test_a_failed_lookup_is_one_line_naming_host_image_and_fix(rc, err, said, fix):
    line = t.lookup_error(t.MANIFEST, f"{REPO}:no-such-tag", "h1", rc, "", err)
    assert "\n" not in line
    assert line.startswith(f"h1: cannot look up {REPO}:no-such-tag in its registry (docker manifest inspect): ")
    assert said in line and f"(fix: {fix}" in line, line


# --- resolve() over fake sessions ----------------------------------------------------------------------------------
def fleet(n: int = 2, image: str = TAG) -> list[FleetHost]:
    return [FleetHost(f"h{i}", build_spec(f"h{i}", {"vllm_image": image}), {}) for i in range(1, n + 1)]


class FakeSessions:
    def __init__(self, unreachable: tuple[str, ...] = ()):
        self.unreachable = unreachable

    def get(self, name: str) -> str:
        if name in self.unreachable:
            raise Unreachable(f"{name}: SSH failed: timed out")
        return name


@pytest.fixture
def host_says(monkeypatch):
    """Answers by the command's first words; every command sent, as (host, command)."""
    sent: list[tuple[str, str]] = []
    answers: dict[str, tuple[int, str, str]] = {}

    def run(session, command, timeout=60.0, root=False):
        assert root  # docker as root: the credentials prepare's pull uses
        sent.append((session, command))
        for prefix, answer in answers.items():
            if prefix in command:
                return answer
        raise AssertionError(f"unexpected command {command!r}")

    monkeypatch.setattr(t, "shell", run)
    return answers, sent


def pulls(sent) -> list[str]:
    return [c for _, c in sent if "docker pull" in c]


def test_a_tag_is_looked_up_with_docker_manifest_on_the_sandbox_and_nothing_is_pulled(host_says):
    answers, sent = host_says
    answers[t.PROBE_COMMAND] = (0, fixture("docker-20.10.24-probe.txt"), "")
    answers["docker manifest inspect -v --insecure"] = (
        0,
        fixture("docker-20.10.24-manifest-inspect-v-single.json"),
        "",
    )
    target = t.resolve(fleet(), FakeSessions(), None)
    assert target == t.Target(f"{REPO}@{GOOD}", TAG, "h1", t.MANIFEST)
    assert target.where == "looked up on h1 with docker manifest inspect: nothing pulled"
    assert [c for _, c in sent] == [t.PROBE_COMMAND, t.lookup_command(t.MANIFEST, TAG, True)]


def test_a_hub_tag_is_looked_up_with_buildx_and_pinned_in_dockers_short_form(host_says):
    answers, sent = host_says
    answers[t.PROBE_COMMAND] = (0, probe_out(t.BUILDX, t.MANIFEST, config=HUB_INFO), "")
    answers["docker buildx imagetools inspect"] = (0, buildx_out(LIST), "")
    image = "docker.io/vllm/vllm-openai:nightly"
    target = t.resolve(fleet(image=image), FakeSessions(), None)
    assert target.ref == f"vllm/vllm-openai@{LIST}" and target.tool == t.BUILDX  # as RepoDigests lists it
    assert not pulls(sent) and len(sent) == 2


def test_an_unreachable_host_passes_the_lookup_to_the_next(host_says):
    answers, sent = host_says
    answers[t.PROBE_COMMAND] = (0, probe_out(t.BUILDX, config=HUB_INFO), "")
    answers["docker buildx"] = (0, buildx_out(LIST), "")
    target = t.resolve(fleet(3), FakeSessions(unreachable=("h1",)), None)
    assert target.resolved_on == "h2" and {h for h, _ in sent} == {"h2"}
    with pytest.raises(GpufleetError, match=r"^cannot resolve .*: no host could be reached .*h1: SSH failed.*h2: "):
        t.resolve(fleet(2), FakeSessions(unreachable=("h1", "h2")), None)


def test_an_unknown_tag_is_one_line_before_anything_and_nothing_is_pulled(host_says):
    answers, sent = host_says
    answers[t.PROBE_COMMAND] = (0, fixture("docker-20.10.24-probe.txt"), "")
    answers["docker manifest"] = (1, "", fixture("docker-20.10.24-manifest-inspect-unknown-tag.stderr"))
    with pytest.raises(GpufleetError) as caught:
        t.resolve(fleet(), FakeSessions(), f"{REPO}:no-such-tag")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"h1: cannot look up {REPO}:no-such-tag") and "(fix: " in line
    assert not pulls(sent) and {h for h, _ in sent} == {"h1"}  # the registry's answer: no other host asked


def test_a_buildx_failure_is_tried_with_docker_manifest(host_says):
    answers, sent = host_says
    answers[t.PROBE_COMMAND] = (0, probe_out(t.BUILDX, t.MANIFEST, config=HUB_INFO), "")
    answers["docker buildx"] = (1, "", "ERROR: failed to list builder nodes\n")
    answers["docker manifest"] = (0, fixture("docker-20.10.24-manifest-inspect-v-single.json"), "")
    assert t.resolve(fleet(), FakeSessions(), None).tool == t.MANIFEST and not pulls(sent)


def test_without_a_lookup_tool_the_tag_is_pulled_and_the_target_says_so(host_says):
    answers, sent = host_says
    answers[t.PROBE_COMMAND] = (0, probe_out(), "")
    answers["docker pull"] = (0, json.dumps([f"{REPO}@{GOOD}"]) + "\n", "")
    target = t.resolve(fleet(), FakeSessions(), None)
    assert target.ref == f"{REPO}@{GOOD}" and target.tool is None
    assert target.where == (
        "pulled on h1: neither docker buildx imagetools nor docker manifest inspect works there "
        "(fix: install docker-buildx-plugin)"
    )
    assert pulls(sent) == [t.resolve_command(TAG)]


def test_a_multi_platform_list_without_buildx_is_pulled_not_pinned_to_one_platform(host_says):
    answers, sent = host_says
    answers[t.PROBE_COMMAND] = (0, fixture("docker-20.10.24-probe.txt"), "")
    answers["docker manifest"] = (0, fixture("docker-20.10.24-manifest-inspect-v-list.json"), "")
    answers["docker pull"] = (0, json.dumps([f"{REPO}@{LIST}"]) + "\n", "")
    target = t.resolve(fleet(), FakeSessions(), None)
    assert target.ref == f"{REPO}@{LIST}" and target.tool is None
    assert "is a multi-platform list" in target.where
    assert target.where.endswith("docker buildx imagetools is not there (fix: install docker-buildx-plugin)")
    assert len(pulls(sent)) == 1


def test_a_refused_sudo_is_one_line(host_says):
    answers, _ = host_says
    answers[t.PROBE_COMMAND] = (1, "", "sudo: a password is required\n")
    with pytest.raises(GpufleetError, match=r"^h1: cannot run docker as root .*sudo: a password is required \(fix: "):
        t.resolve(fleet(), FakeSessions(), None)


def test_a_digest_is_used_as_given_without_a_command(host_says):
    _, sent = host_says
    target = t.resolve(fleet(), FakeSessions(), f"{REPO}@{GOOD}")
    assert target == t.Target(f"{REPO}@{GOOD}", f"{REPO}@{GOOD}") and target.where == "" and not sent
