"""Profiles: known-good service definitions that host data refines, one module each (docs/profiles.md)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from types import ModuleType

from gpufleet.vllm.profiles._profile import CACHE_ROOT, Profile

__all__ = ["CACHE_ROOT", "PROFILES", "Profile", "discover"]


def discover(package: ModuleType) -> dict[str, Profile]:
    """{name: Profile} from a package's modules; "_"-prefixed modules are helpers."""
    found: dict[str, Profile] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        profile = getattr(module, "PROFILE", None)
        if not isinstance(profile, Profile):
            raise TypeError(f"{module.__name__} defines no PROFILE = Profile(...)")
        if profile.name in found:
            raise ValueError(f"{module.__name__}: profile name {profile.name!r} is taken by another module")
        found[profile.name] = profile
    return found


PROFILES: dict[str, Profile] = discover(sys.modules[__name__])
