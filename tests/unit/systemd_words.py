"""Test helper: split an ExecStart= value the way systemd does (extract_first_word with UNQUOTE|CUNESCAPE,
then $$ -> $ and %% -> %), so tests can prove the unit runs exactly the spec's argv."""

from __future__ import annotations

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'", "s": " "}


def split_exec(value: str) -> list[str]:
    words: list[str] = []
    i, n = 0, len(value)
    while i < n:
        while i < n and value[i] in " \t":
            i += 1
        if i >= n:
            break
        word, quote = [], None
        while i < n:
            c = value[i]
            if quote is None and c in " \t":
                break
            if c == "\\" and i + 1 < n:
                word.append(_ESCAPES.get(value[i + 1], value[i + 1]))
                i += 2
                continue
            if quote is None and c in "\"'":
                quote, i = c, i + 1
                continue
            if quote is not None and c == quote:
                quote, i = None, i + 1
                continue
            word.append(c)
            i += 1
        assert quote is None, f"unterminated quote in {value!r}"
        words.append("".join(word).replace("$$", "\0").replace("%%", "%").replace("\0", "$"))
    return words
