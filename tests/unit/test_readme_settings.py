"""README.md's settings table documents exactly the settings in gpufleet.defaults, with their defaults."""

from __future__ import annotations

import ast
import re

from gpufleet.defaults import DEFAULTS
from tests.conftest import REPO

ROW = re.compile(r"^\| `(?P<name>\w+)` \| `(?P<default>.*?)` \| (?P<doc>.+) \|$")


def readme_rows() -> dict[str, tuple[str, str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Settings", 1)[1].split("\n## ", 1)[0]
    return {m["name"]: (m["default"], m["doc"]) for m in map(ROW.match, section.splitlines()) if m}


def test_every_setting_is_documented_and_nothing_else():
    assert set(readme_rows()) == set(DEFAULTS)


def test_documented_defaults_match_the_code():
    for name, (default, doc) in readme_rows().items():
        assert ast.literal_eval(default) == DEFAULTS[name], name
        assert len(doc.strip()) > 10, f"{name} needs a description"
