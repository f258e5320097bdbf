"""Text a server or host sent, quoted as one line of evidence without line breaks or terminal escapes."""

from __future__ import annotations

DETAIL_CHARS = 400


def excerpt(text: str | bytes, limit: int = 80) -> str:
    """At most `limit` characters, non-printable ones escaped."""
    if isinstance(text, bytes):
        text = text[: limit + 1].decode("utf-8", errors="backslashreplace")
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text[: limit + 1])
    return out if len(out) <= limit else out[: limit - 3] + "..."
