"""What "serving what it should" means: the expected identity, /v1/models parsed, and how a server differs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpufleet.names import LOOPBACK
from gpufleet.wire.evidence import excerpt


class SpecIdentity(Protocol):
    """What Expected.from_spec reads of a ServeSpec, so that the wire names no slice."""

    @property
    def service(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def served_model_name(self) -> str: ...
    @property
    def max_model_len(self) -> int | None: ...
    @property
    def prefix_caching(self) -> bool: ...
    @property
    def mamba_cache_mode(self) -> str | None: ...
    @property
    def reach_address(self) -> str: ...


class SpecArgs(SpecIdentity, Protocol):
    """What the health checks read of a ServeSpec besides its identity."""

    @property
    def host(self) -> str: ...
    @property
    def gpus(self) -> tuple[int, ...]: ...
    @property
    def spec_hash(self) -> str: ...
    def arg(self, name: str) -> bool | str | None: ...


@dataclass(frozen=True)
class Expected:
    """What a host should serve."""

    service: str
    port: int
    served_model_name: str
    max_model_len: int | None = None
    cache_config: dict[str, str] = field(default_factory=dict)  # vllm:cache_config_info labels, matched exactly
    spec_hash: str | None = None  # the container label's; None: not compared
    address: str = LOOPBACK

    @classmethod
    def from_spec(cls, spec: SpecIdentity) -> Expected:
        cache = {"enable_prefix_caching": str(bool(spec.prefix_caching))}
        if spec.mamba_cache_mode:
            cache["mamba_cache_mode"] = str(spec.mamba_cache_mode)
        return cls(
            service=spec.service,
            port=int(spec.port),
            served_model_name=spec.served_model_name,
            max_model_len=spec.max_model_len,
            cache_config=cache,
            address=spec.reach_address,
        )


def reported_max_model_len(expected: Expected, models: list[tuple[str, int | None]]) -> int | None:
    """The max_model_len of the expected model, or of the first one listed when it is not served."""
    served = next((m for m in models if m[0] == expected.served_model_name), None)
    return (served or (models[0] if models else (None, None)))[1]


def identity_problems(
    expected: Expected, models: list[tuple[str, int | None]], cache_config: dict[str, str]
) -> list[str]:
    """How a server that answers /health 200 differs from `expected`; [] when it does not."""
    ids = [model_id for model_id, _ in models]
    max_model_len = reported_max_model_len(expected, models)
    problems = []
    if expected.served_model_name not in ids:
        listed = ", ".join(excerpt(i) for i in ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
        problems.append(f"serves {listed or 'nothing'}, expected {expected.served_model_name}")
    if expected.max_model_len is not None and max_model_len != expected.max_model_len:
        problems.append(f"max_model_len {max_model_len}, expected {expected.max_model_len}")
    for key, want in expected.cache_config.items():
        got = cache_config.get(key)
        if got != want:
            problems.append(f"{key}={excerpt(got) if got is not None else None}, expected {want}")
    return problems


def served_models(body: bytes) -> list[tuple[str, int | None]]:
    """/v1/models' (id, max_model_len) pairs in the server's order; ValueError saying how the body is wrong."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past the parser's limit
        raise ValueError(f"is not JSON: {excerpt(body) or 'an empty body'}") from e
    if not isinstance(doc, dict):
        raise ValueError(f'is a JSON {_json_type(doc)}, not an object with a "data" list')
    data = doc.get("data")
    if not isinstance(data, list):
        raise ValueError(
            'has no "data" list' if data is None else f'has "data" as a JSON {_json_type(data)}, not a list'
        )
    models = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"item {i} is a JSON {_json_type(item)}, not a model object")
        model_id, limit = item.get("id"), item.get("max_model_len")
        if not isinstance(model_id, str):
            raise ValueError(
                f"item {i} has {'no id' if model_id is None else 'an id that is a JSON ' + _json_type(model_id)}"
            )
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
            raise ValueError(f"item {i} ({excerpt(model_id)}) has a max_model_len that is a JSON {_json_type(limit)}")
        models.append((model_id, limit))
    return models


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
