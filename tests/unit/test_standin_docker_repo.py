"""The Docker repo stand-in's pure parts: versions in Docker's scheme and the CLI plugin stand-ins' answers (the repo
itself is built from the mirror's debs and installed on real hosts in the integration tier)."""

from __future__ import annotations

import json
import subprocess

import pytest

from gpufleet.sandbox.docker_repo import PLUGIN, upstream_version


@pytest.mark.parametrize(
    ("deb_version", "upstream"),
    [
        ("20.10.24+dfsg1-1+deb12u1+b6", "20.10.24"),
        ("1.6.20~ds1-1+deb12u3", "1.6.20"),
        ("1.1.5+ds1-1+deb12u1", "1.1.5"),
        ("5:28.3.3-1~debian.12~bookworm", "28.3.3"),
    ],
)
def test_upstream_version(deb_version, upstream):
    assert upstream_version(deb_version) == upstream


def test_plugin_stand_in_answers_the_cli_metadata_call_and_refuses_work(tmp_path):
    script = tmp_path / "docker-buildx"
    script.write_text(PLUGIN.format(name="docker-buildx-plugin", what="Docker Buildx", cmd="buildx"))
    meta = subprocess.run(["sh", str(script), "docker-cli-plugin-metadata"], capture_output=True, text=True)
    assert meta.returncode == 0
    assert json.loads(meta.stdout) == {
        "SchemaVersion": "0.1.0",
        "Vendor": "gpufleet sandbox (stand-in)",
        "Version": "v0.0.0",
        "ShortDescription": "Docker Buildx (stand-in: not available in the sandbox)",
    }
    build = subprocess.run(["sh", str(script), "buildx", "build", "."], capture_output=True, text=True)
    assert build.returncode == 1 and "stand-in" in build.stderr
