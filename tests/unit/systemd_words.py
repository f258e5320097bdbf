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


def unit_directives(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for every directive of a unit file, read as systemd reads it: lines end at LF, CR or
    NUL; '#' and ';' lines are comments; a trailing backslash joins the next line."""
    directives, section, pending = [], "", ""
    for raw in text.replace("\r", "\n").replace("\0", "\n").split("\n"):
        continued, line, pending = bool(pending), pending + raw.strip(), ""
        if not line or (line[0] in "#;" and not continued):
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        directives.append((section, key.strip(), value.strip()))
    return directives
