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


def test_max_fails_only_above_the_bound(tmp_path, capsys):
    module = tmp_path / "m.py"
    module.write_text(SOURCE)  # 10 words over 6 code lines
    main = load().main
    assert main(["--max", "1.7", str(module)]) == 0
    assert main(["--max", str(10 / 6), str(module)]) == 0
    capsys.readouterr()
    assert main(["--max", "1.6", str(module)]) == 1
    assert "1.667 is above the bound 1.6" in capsys.readouterr().err
