"""Profiles: known-good service definitions that host data refines, one module each.

A profile module defines `PROFILE = Profile(...)`; every module in this package whose name does not start with
"_" is one, found at import time, so adding a profile is one new file here plus its golden render test
(docs/profiles.md). A profile also carries the defaults of the settings that depend on the model
(Profile.settings): vllm_gpus, vllm_model, vllm_model_repo, vllm_model_revision, vllm_service, vllm_cache_dir.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from types import ModuleType

from gpufleet.vllm.profiles._profile import CACHE_ROOT, Profile

__all__ = ["CACHE_ROOT", "PROFILES", "Profile", "discover"]


def discover(package: ModuleType) -> dict[str, Profile]:
    """{profile name: Profile} from the modules of a package, by module name; "_"-prefixed modules are helpers."""
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
