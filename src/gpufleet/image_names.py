"""Image references parsed strictly, normalised to docker's short form (docs/hardening.md, "Normalised").

Compare what the user wrote with what docker reports by normalise() on both sides.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# docker's grammar (distribution/reference).
_DOMAIN = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]{1,5})?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REFERENCE = re.compile(
    rf"(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?"
)
_HUB = ("docker.io", "index.docker.io")


@dataclass(frozen=True)
class ImageRef:
    repository: str  # normalised
    tag: str | None
    digest: str | None  # "sha256:<64 hex>"

    def __str__(self) -> str:
        return self.repository + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    @property
    def pinned(self) -> str | None:
        """ "repo@sha256:..." when there is a digest, which wins over the tag."""
        return f"{self.repository}@{self.digest}" if self.digest else None


def parse(text: str) -> ImageRef | None:
    """The reference, normalised; None when docker would refuse it."""
    match = _REFERENCE.fullmatch(text) if isinstance(text, str) else None
    if not match:
        return None
    domain, path = match["domain"], match["path"]
    if domain is not None and not ("." in domain or ":" in domain or domain == "localhost"):
        if domain != domain.lower():
            return None
        path, domain = f"{domain}/{path}", None
    if domain in _HUB:
        domain = None
    if domain is None and path.startswith("library/") and path.count("/") == 1:
        path = path.removeprefix("library/")
    repository = f"{domain}/{path}" if domain else path
    return ImageRef(repository, match["tag"], match["digest"])


def normalise(text: str) -> str:
    """docker's short form of a reference; unchanged when it does not parse."""
    ref = parse(text)
    return str(ref) if ref else text


def repository(image: str) -> str:
    """The repository as docker lists it; a registry port is no tag."""
    ref = parse(image)
    if ref is not None:
        return ref.repository
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]
