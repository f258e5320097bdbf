"""Text a server or a host sent, quoted as evidence on one line: never a line break or a terminal escape."""

from __future__ import annotations

DETAIL_CHARS = 400  # a detail is one line of evidence, not a dump of what the server sent


def excerpt(text: str | bytes, limit: int = 80) -> str:
    """Server-sent text quoted as evidence in a one-line detail: control and other non-printable characters
    escaped (no line breaks, no terminal escapes), at most `limit` characters.

    >>> excerpt("ok\\r\\nX-Evil: 1\\x1b[2J")
    'ok\\\\r\\\\nX-Evil: 1\\\\x1b[2J'
    """
    if isinstance(text, bytes):
        text = text[: limit + 1].decode("utf-8", errors="backslashreplace")
    # Escaping only lengthens, so the first limit + 1 characters decide the result.
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text[: limit + 1])
    return out if len(out) <= limit else out[: limit - 3] + "..."
