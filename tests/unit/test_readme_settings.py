"""README.md's settings table documents exactly the settings in gpufleet.defaults, with their defaults."""

from __future__ import annotations

import ast
import re

from gpufleet.defaults import DEFAULTS, FROM_PROFILE, PROFILE_SETTINGS
from tests.conftest import REPO

# A default is a Python literal in backticks, or the word profile's (the host's profile supplies it).
ROW = re.compile(r"^\| `(?P<name>\w+)` \| (?:`(?P<default>.*?)`|(?P<profile>profile's)) \| (?P<doc>.+) \|$")


def readme_rows() -> dict[str, tuple[object, str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Settings", 1)[1].split("\n## ", 1)[0]
    return {
        m["name"]: (FROM_PROFILE if m["profile"] else ast.literal_eval(m["default"]), m["doc"])
        for m in map(ROW.match, section.splitlines())
        if m
    }


def test_every_setting_is_documented_and_nothing_else():
    assert set(readme_rows()) == set(DEFAULTS)


def test_documented_defaults_match_the_code():
    for name, (default, doc) in readme_rows().items():
        assert default == DEFAULTS[name], name
        assert len(doc.strip()) > 10, f"{name} needs a description"


def test_the_settings_a_profile_supplies_are_the_model_dependent_ones():
    model_dependent = {
        "vllm_gpus",
        "vllm_model",
        "vllm_model_repo",
        "vllm_model_revision",
        "vllm_service",
        "vllm_cache_dir",
    }
    assert model_dependent == PROFILE_SETTINGS
