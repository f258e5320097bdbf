"""tools/prose_ratio.py: the prose figure CI prints (words of comments and docstrings per code line)."""

from __future__ import annotations

import importlib.util
import sys

from tests.conftest import REPO

SOURCE = '''"""Module doc: four words."""

import os  # why this import


class A:
    """One."""


def f(x):
    """Two words."""
    y = (
        "a string alone on its line is no code"
    )
    return x, y, os  # type: ignore[return-value]
'''


def load():
    spec = importlib.util.spec_from_file_location("gpufleet_prose_ratio", REPO / "tools" / "prose_ratio.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_docstrings_and_comments_are_counted_in_words_and_code_in_lines():
    prose = load().measure(SOURCE)
    # Code lines: import, class, def, `y = (`, `)`, return. A directive is no prose, a lone string no code.
    assert (prose.comment_words, prose.docstring_words, prose.code_lines) == (3, 4 + 1 + 2, 6)
    assert prose.ratio == 10 / 6


def test_the_figure_covers_src(capsys):
    assert load().main([]) == 0
    assert capsys.readouterr().out.startswith("prose: ")
