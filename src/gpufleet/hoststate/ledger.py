"""The host's ledger, a pure state machine: begin(), then commit() or roll_back(); resume() first settles a cut run
(docs/crash-safety.md, "The ledger")."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from gpufleet.defaults import RETRY_SETTING
from gpufleet.errors import GpufleetError, one_line
from gpufleet.names import SERVICE_NAME
from gpufleet.wire.speed import SpeedFigures

SCHEMA = 2
_MODEL = re.compile(r"[^@\s]+/[^@\s]+@[0-9a-f]{40}")
HISTORY_LIMIT = 20
FAILED_LIMIT = 20


class CorruptLedger(GpufleetError):
    """Not a ledger this module wrote or migrates."""

    def __init__(self, reason: str):
        self.reason = one_line(reason)
        super().__init__(self.reason)


def corrupt_refusal(host: str, path: str, error: CorruptLedger) -> str:
    """Preflight's line for a corrupt ledger; the deploy must not guess which digest runs."""
    return one_line(
        f"{host}: {path} is corrupt: {error.reason} (fix: repair it by hand, or move it away to start a "
        "new ledger: the next converge then resolves vllm_image again and the rollback history is lost)"
    )


@dataclass(frozen=True)
class Version:
    """One installable version of the service; None: not in an older ledger."""

    image: str  # vllm_image as configured
    ref: str  # repo@sha256:...
    unit_sha256: str | None
    spec_hash: str | None  # the container's label value
    service: str | None
    port: int | None
    model: str | None = None  # org/name@<40 hex commit>
    model_revision: str | None = None  # as configured; None: the repo's default branch
    group: str | None = None  # "<group>@<hash>", alike on every rank of a replica group


@dataclass(frozen=True)
class Committed:
    version: Version
    committed_at: str
    ready_at: str | None = None  # first ready after its restart
    speed: SpeedFigures | None = None  # from its verify's speed check
    gpu: str | None = None  # the GPU verdict at its swap


@dataclass(frozen=True)
class Pending:
    version: Version
    started_at: str
    operator: str  # "user@controller pid N"


@dataclass(frozen=True)
class Failed:
    ref: str
    spec_hash: str | None  # None: marked by the old format
    reason: str
    failed_at: str
    image: str | None = None  # vllm_image as configured when it failed
    check: str | None = None  # the verify check it failed, if one
    gpu: str | None = None
    model: str | None = None  # None: any model

    def matches(self, version: Version) -> bool:
        """Same digest and settings, and same model when both name one."""
        return (
            self.ref == version.ref
            and (self.spec_hash is None or self.spec_hash == version.spec_hash)
            and self.holds_for(version.model)
        )

    def holds_for(self, model: str | None) -> bool:
        """Does the mark cover `model`? None on either side stands for any."""
        return self.model is None or model is None or self.model == model


@dataclass(frozen=True)
class Ledger:
    committed: Committed | None = None
    pending: Pending | None = None
    failed: tuple[Failed, ...] = ()
    history: tuple[Committed, ...] = ()  # oldest first


class LedgerStateError(GpufleetError):
    """A transition the ledger's state does not allow: the caller's bug."""


def begin(ledger: Ledger, target: Version, operator: str, now: str) -> Ledger:
    """The ledger to write before `target` first restarts."""
    if ledger.pending is not None:
        raise LedgerStateError(f"a pending change from {ledger.pending.operator} is not settled yet")
    return replace(ledger, pending=Pending(version=target, started_at=now, operator=operator))


def commit(
    ledger: Ledger, now: str, ready_at: str | None = None, speed: SpeedFigures | None = None, gpu: str | None = None
) -> Ledger:
    """After the pending version passed verify and the soak."""
    pending = _pending(ledger, "commit")
    history = ledger.history
    if ledger.committed is not None and ledger.committed.version != pending.version:
        history = (*history, ledger.committed)[-HISTORY_LIMIT:]
    failed = tuple(f for f in ledger.failed if not f.matches(pending.version))
    return Ledger(
        committed=Committed(pending.version, now, ready_at, speed, gpu), pending=None, failed=failed, history=history
    )


def roll_back(ledger: Ledger, reason: str, now: str, check: str | None = None, gpu: str | None = None) -> Ledger:
    """After the pending version failed and the committed one was put back."""
    pending = _pending(ledger, "roll back")
    mark = Failed(
        ref=pending.version.ref,
        spec_hash=pending.version.spec_hash,
        reason=one_line(reason),
        failed_at=now,
        image=pending.version.image,
        check=check,
        gpu=gpu,
        model=pending.version.model,
    )
    failed = (
        *(f for f in ledger.failed if (f.ref, f.spec_hash, f.model) != (mark.ref, mark.spec_hash, mark.model)),
        mark,
    )
    return replace(ledger, pending=None, failed=failed[-FAILED_LIMIT:])


def drop_pending(ledger: Ledger) -> Ledger:
    """When the pending change never reached the host; marks nothing."""
    _pending(ledger, "drop")
    return replace(ledger, pending=None)


def refused_target(ledger: Ledger, target: Version) -> str | None:
    """Why a plain converge must not install `target`, or None. The caller prefixes the host."""
    mark = next((f for f in reversed(ledger.failed) if f.matches(target)), None)
    if mark is None:
        return None
    settings = "" if mark.spec_hash is None else f" with spec {mark.spec_hash}"
    model = "" if mark.model is None else f" and model {mark.model}"
    return one_line(
        f"{mark.ref}{settings}{model} failed at {mark.failed_at}: {mark.reason} (fix: change vllm_image "
        f"or a setting, or pass --data {RETRY_SETTING}=true to one converge to try it again on purpose)"
    )


def pin(ledger: Ledger, image: str) -> str | None:
    """The digest the tag `image` stands for here, or None to resolve it; a failed tag keeps its digest."""
    if ledger.pending is not None and ledger.pending.version.image == image:
        return ledger.pending.version.ref
    if ledger.committed is not None and ledger.committed.version.image == image:
        return ledger.committed.version.ref
    return next((f.ref for f in reversed(ledger.failed) if f.image == image), None)


def model_pin(ledger: Ledger, repo: str, revision: str | None) -> str | None:
    """pin() for the model: its commit, or None to resolve it."""
    for record in (ledger.pending, ledger.committed):
        v = record.version if record is not None else None
        if v is not None and v.model and v.model.rpartition("@")[0] == repo and v.model_revision == revision:
            return v.model
    return None


def retry_failed(ledger: Ledger, target: Version) -> Ledger:
    """The ledger with target's failure marks cleared, for `gpufleet_retry_failed`."""
    return replace(ledger, failed=tuple(f for f in ledger.failed if not f.matches(target)))


def _pending(ledger: Ledger, what: str) -> Pending:
    if ledger.pending is None:
        raise LedgerStateError(f"nothing pending to {what}")
    return ledger.pending


@dataclass(frozen=True)
class Observed:
    """What the host really runs, from the snapshot; None: no unit, no container."""

    unit_sha256: str | None
    running_ref: str | None
    running_spec_hash: str | None
    active: bool
    restarts: int = 0


@dataclass(frozen=True)
class FinishPending:
    """The pending unit is installed: (re)start it when `restart`, verify, then commit() or roll_back()."""

    pending: Pending
    restart: bool
    reason: str


@dataclass(frozen=True)
class RollBackPending:
    """Put the committed version back, verify it, then roll_back(reason)."""

    pending: Pending
    committed: Committed
    reason: str


@dataclass(frozen=True)
class DropPending:
    """The pending change never reached the unit: drop_pending()."""

    pending: Pending
    reason: str


@dataclass(frozen=True)
class Nothing:
    reason: str


Resume = FinishPending | RollBackPending | DropPending | Nothing


def resume(ledger: Ledger, observed: Observed) -> Resume:
    """What a run does first about a cut run's pending record."""
    pending, committed = ledger.pending, ledger.committed
    if pending is None:
        return Nothing("no pending change")
    want = pending.version
    who = f"cut change by {pending.operator} since {pending.started_at}"
    runs_pending = observed.active and observed.running_ref == want.ref and observed.running_spec_hash == want.spec_hash
    if observed.unit_sha256 == want.unit_sha256:
        if runs_pending and observed.restarts > 0 and committed is not None:
            return RollBackPending(pending, committed, f"{want.ref} restarted {observed.restarts} times after a {who}")
        if runs_pending:
            return FinishPending(pending, restart=False, reason=f"{who}: the new version runs, not yet verified")
        return FinishPending(pending, restart=True, reason=f"{who}: the new unit is installed but not running")
    if committed is None:
        # A first install cut short has nothing to go back to.
        return FinishPending(pending, restart=True, reason=f"{who}: first install, no committed version")
    if committed.version.unit_sha256 is not None and observed.unit_sha256 == committed.version.unit_sha256:
        return DropPending(pending, f"{who}: the unit is still the committed version's")
    return RollBackPending(
        pending, committed, f"{who}: the unit on the host is neither the pending nor the committed version's"
    )


def parse(text: str) -> Ledger:
    """The ledger in `text`, an old format migrated; raises CorruptLedger."""
    if not text.strip():
        raise CorruptLedger("empty file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CorruptLedger(f"not JSON: {err}") from None
    if not isinstance(data, dict):
        raise CorruptLedger(f"not a JSON object but {_kind(data)}")
    if "schema" in data:
        if data["schema"] != SCHEMA:
            raise CorruptLedger(f"schema: {data['schema']!r} is not {SCHEMA} (a newer gpufleet wrote it?)")
        return _parse_v2(data)
    if "current" in data:
        return _migrate_v1(data)
    raise CorruptLedger("neither a 'schema' nor a 'current' key")


def render(ledger: Ledger) -> str:
    """Stable text: a re-render changes no byte."""
    doc = {
        "schema": SCHEMA,
        "committed": _committed_doc(ledger.committed),
        "pending": None
        if ledger.pending is None
        else {
            **_version_doc(ledger.pending.version),
            "started_at": ledger.pending.started_at,
            "operator": ledger.pending.operator,
        },
        "failed": [
            {
                "ref": f.ref,
                "spec_hash": f.spec_hash,
                "reason": f.reason,
                "failed_at": f.failed_at,
                "image": f.image,
                **({"check": f.check} if f.check else {}),
                **_gpu_doc(f.gpu),
                **({"model": f.model} if f.model else {}),
            }
            for f in ledger.failed
        ],
        "history": [_committed_doc(c) for c in ledger.history],
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def _version_doc(v: Version) -> dict[str, Any]:
    model = {"model": v.model, "model_revision": v.model_revision} if v.model else {}
    return {
        "image": v.image,
        "ref": v.ref,
        "unit_sha256": v.unit_sha256,
        "spec_hash": v.spec_hash,
        "service": v.service,
        "port": v.port,
        **model,
        **({"group": v.group} if v.group is not None else {}),
    }


def _committed_doc(c: Committed | None) -> dict[str, Any] | None:
    if c is None:
        return None
    speed = {"speed": c.speed.as_dict()} if c.speed else {}
    return {
        **_version_doc(c.version),
        "committed_at": c.committed_at,
        "ready_at": c.ready_at,
        **speed,
        **_gpu_doc(c.gpu),
    }


def _gpu_doc(gpu: str | None) -> dict[str, str]:
    return {"gpu": gpu} if gpu is not None else {}


def _kind(value: object) -> str:
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def _field(doc: dict[str, Any], where: str, key: str, kind: type, optional: bool = False) -> Any:
    if key not in doc:
        raise CorruptLedger(f"{where}.{key}: missing")
    value = doc[key]
    if value is None and optional:
        return None
    # bool is an int to isinstance().
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        wanted = {str: "a string", int: "an integer", dict: "an object", list: "a list"}[kind]
        raise CorruptLedger(f"{where}.{key}: expected {wanted}{' or null' if optional else ''}, got {_kind(value)}")
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CorruptLedger(f"{where}: expected an object, got {_kind(value)}")
    return value


def _digest_ref(doc: dict[str, Any], where: str) -> str:
    ref: str = _field(doc, where, "ref", str)
    if not _DIGEST_REF.fullmatch(ref):
        raise CorruptLedger(f"{where}.ref: {ref!r} is not a digest ref (repo@sha256:<64 hex digits>)")
    return ref


# Root makes file names of the service and docker arguments of the ref.
_DIGEST_REF = re.compile(r"[^\s@]+@sha256:[0-9a-f]{64}")


def _matching(doc: dict[str, Any], where: str, key: str, pattern: re.Pattern[str], what: str) -> str | None:
    value: str | None = _field(doc, where, key, str, optional=True)
    if value is not None and not pattern.fullmatch(value):
        raise CorruptLedger(f"{where}.{key}: {one_line(repr(value))[:80]} is not {what}")
    return value


def _version(doc: dict[str, Any], where: str) -> Version:
    image, ref = _field(doc, where, "image", str), _digest_ref(doc, where)
    unit_sha256 = _field(doc, where, "unit_sha256", str, optional=True)
    spec_hash = _field(doc, where, "spec_hash", str, optional=True)
    service = _matching(doc, where, "service", SERVICE_NAME, "a service name (letters, digits, '-', '_', '.')")
    port = _field(doc, where, "port", int, optional=True)
    if port is not None and not 1 <= port <= 65535:
        raise CorruptLedger(f"{where}.port: {port} is not a TCP port (1-65535)")
    model = _field(doc, where, "model", str, optional=True) if "model" in doc else None
    if model is not None and not _MODEL.fullmatch(model):
        raise CorruptLedger(f"{where}.model: {model!r} is not <org>/<name>@<40 hex commit>")
    revision = _field(doc, where, "model_revision", str, optional=True) if "model_revision" in doc else None
    group = _field(doc, where, "group", str, optional=True) if "group" in doc else None
    return Version(
        image=image,
        ref=ref,
        unit_sha256=unit_sha256,
        spec_hash=spec_hash,
        service=service,
        port=port,
        model=model,
        model_revision=revision,
        group=group,
    )


def _committed(value: Any, where: str) -> Committed:
    doc = _object(value, where)
    ready_at = _field(doc, where, "ready_at", str, optional=True) if "ready_at" in doc else None
    speed = None
    if doc.get("speed") is not None:
        try:
            speed = SpeedFigures.from_dict(doc["speed"])
        except ValueError as error:
            raise CorruptLedger(f"{where}.speed: {error}") from None
    gpu = _field(doc, where, "gpu", str, optional=True) if "gpu" in doc else None
    return Committed(_version(doc, where), _field(doc, where, "committed_at", str), ready_at, speed, gpu)


def _parse_v2(data: dict[str, Any]) -> Ledger:
    committed = None if data.get("committed") is None else _committed(data["committed"], "committed")
    pending = None
    if data.get("pending") is not None:
        doc = _object(data["pending"], "pending")
        pending = Pending(
            _version(doc, "pending"), _field(doc, "pending", "started_at", str), _field(doc, "pending", "operator", str)
        )
    failed = []
    for i, item in enumerate(_field(data, "ledger", "failed", list)):
        where = f"failed[{i}]"
        doc = _object(item, where)
        image = _field(doc, where, "image", str, optional=True) if "image" in doc else None
        check = _field(doc, where, "check", str, optional=True) if "check" in doc else None
        gpu = _field(doc, where, "gpu", str, optional=True) if "gpu" in doc else None
        model = _matching(doc, where, "model", _MODEL, "<org>/<name>@<40 hex commit>") if "model" in doc else None
        failed.append(
            Failed(
                ref=_field(doc, where, "ref", str),
                spec_hash=_field(doc, where, "spec_hash", str, True),
                reason=_field(doc, where, "reason", str),
                failed_at=_field(doc, where, "failed_at", str),
                image=image,
                check=check,
                gpu=gpu,
                model=model,
            )
        )
    history = tuple(_committed(item, f"history[{i}]") for i, item in enumerate(_field(data, "ledger", "history", list)))
    return Ledger(committed=committed, pending=pending, failed=tuple(failed), history=history)


def _old_entry(value: Any, where: str) -> tuple[Committed, Failed | None]:
    doc = _object(value, where)
    ref = _digest_ref(doc, where)
    version = Version(
        image=_field(doc, where, "image", str), ref=ref, unit_sha256=None, spec_hash=None, service=None, port=None
    )
    pinned_at = _field(doc, where, "pinned_at", str)
    failed = None
    if doc.get("failed"):
        failed = Failed(
            ref=ref,
            spec_hash=None,
            reason=one_line(str(doc["failed"])),
            failed_at=_field(doc, where, "failed_at", str),
            image=version.image,
        )
    return Committed(version, pinned_at), failed


def _migrate_v1(data: dict[str, Any]) -> Ledger:
    """The old format: `current` becomes `committed`, the history's failed entries failure marks."""
    committed = None if data["current"] is None else _old_entry(data["current"], "current")[0]
    history: list[Committed] = []
    failed: list[Failed] = []
    for i, item in enumerate(_field(data, "ledger", "history", list) if "history" in data else []):
        entry, mark = _old_entry(item, f"history[{i}]")
        if mark is not None:
            failed.append(mark)
        elif committed is None or entry.version != committed.version:
            history.append(entry)
    return Ledger(
        committed=committed, pending=None, failed=tuple(failed[-FAILED_LIMIT:]), history=tuple(history[-HISTORY_LIMIT:])
    )
