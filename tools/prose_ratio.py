"""Words of comments and docstrings per line of code, over src/ (issue 41's prose figure; its target is under 1.7).

A code line holds at least one token that is neither a string nor a comment; a docstring is the string that opens a
module, class or function (ast), a comment is tokenize's. Tool directives (`# type: ignore`, `# noqa`, `# fmt: ...`)
are not prose and do not count. Run: python tools/prose_ratio.py [--max BOUND] [paths...] (default: src/);
with --max it exits 1 when the figure is above BOUND.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIRECTIVE = re.compile(r"#\s*(type:|noqa\b|fmt:|pragma:)")
NOT_CODE = {
    tokenize.COMMENT,
    tokenize.STRING,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}


@dataclass(frozen=True)
class Prose:
    comment_words: int = 0
    docstring_words: int = 0
    code_lines: int = 0

    def __add__(self, other: Prose) -> Prose:
        return Prose(
            self.comment_words + other.comment_words,
            self.docstring_words + other.docstring_words,
            self.code_lines + other.code_lines,
        )

    @property
    def ratio(self) -> float:
        return (self.comment_words + self.docstring_words) / self.code_lines if self.code_lines else 0.0


def measure(source: str) -> Prose:
    """The figures of one module's source."""
    comment_words, code_rows = 0, set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comment_words += len(DIRECTIVE.split(token.string, maxsplit=1)[0].lstrip("#").split())
        elif token.type not in NOT_CODE:
            code_rows.add(token.start[0])
    docstrings = (
        ast.get_docstring(node, clean=False)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    )
    return Prose(comment_words, sum(len(text.split()) for text in docstrings if text), len(code_rows))


def measure_paths(paths: list[Path]) -> Prose:
    files = sorted({f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py"))})
    return sum((measure(f.read_text()) for f in files), Prose())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="prose_ratio.py", description="Words of comments and docstrings per code line."
    )
    parser.add_argument("--max", type=float, metavar="BOUND", help="exit 1 when the figure is above BOUND")
    parser.add_argument("paths", nargs="*", type=Path, help="files or directories (default: src/)")
    args = parser.parse_args(argv)
    prose = measure_paths(args.paths or [REPO / "src"])
    print(
        f"prose: {prose.ratio:.2f} words of comments and docstrings per code line "
        f"({prose.comment_words} comment words + {prose.docstring_words} docstring words / {prose.code_lines} code lines)"
    )
    if args.max is not None and prose.ratio > args.max:
        print(
            f"prose: {prose.ratio:.3f} is above the bound {args.max:g} (fix: cut comments and docstrings to what "
            "a maintainer needs, issue 41)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
