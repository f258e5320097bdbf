"""The verify step of a replica group: the head verifies, every rank takes its verdict (docs/multi-node.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from pyinfra.api import Host, State

from gpufleet.health import HealthReport, HealthState
from gpufleet.operations.base import fail
from gpufleet.operations.run import run_context
from gpufleet.remote.ssh import transport_from_pyinfra_host
from gpufleet.remote.transport import TransportError
from gpufleet.vllm.operations.group import GroupRun
from gpufleet.vllm.verify import Verification, VerifyOutcome, VerifyOutcomes, installed_problem, outcome, verify_rollout
from gpufleet.wire.identity import Expected

# How much longer than the head's ready timeout and soak a rank waits: the checks that follow them.
VERDICT_MARGIN_S = 900.0


@dataclass(frozen=True)
class GroupVerification(Verification):
    """Verification for a rank of `group`."""

    group: GroupRun | None = None

    @property
    def _group(self) -> GroupRun:
        assert self.group is not None
        return self.group

    def verify(self, state: State, host: Host, soak_s: float) -> bool:
        member = self._group.member
        if host.name == member.head:
            try:
                found = verify_rollout(host, self, soak_s)
                if found is not None and found.passed:
                    found = ranks_installed(state, self._group, self.spec.service) or found
                if found is not None:
                    run_context(state).slot(VerifyOutcomes, VerifyOutcomes)[host.name] = found
            finally:
                self._group.verified.set()
            return found is not None
        wait_s = self.timeout_s + soak_s + VERDICT_MARGIN_S
        host.log_styled(f"waiting up to {wait_s:.0f} s for the head {member.head}'s verdict on group {member.group}")
        self._group.verified.wait(wait_s)
        found = outcome(state.inventory.get_host(member.head))
        if found is None:
            return fail(
                host,
                f"{host.name}: the head {member.head} did not finish verifying group {member.group}; "
                "nothing was committed or rolled back, this rank's new version stays pending (fix: "
                "converge the group again: the next run verifies it)",
            )
        run_context(state).slot(VerifyOutcomes, VerifyOutcomes)[host.name] = found
        return True

    def check_once(self, host: Host, expected: Expected) -> Callable[[], HealthReport]:
        """A rank is ready when its head is, with its own container's report."""
        member = self._group.member
        head = super().check_once(host.state.inventory.get_host(member.head), expected)
        if host.name == member.head:
            return head
        transport, service = transport_from_pyinfra_host(host), self.spec.service

        def look() -> HealthReport:
            report = head()
            try:
                return replace(report, container=transport.container(service))
            except TransportError as error:
                return HealthReport(HealthState.SSH_UNREACHABLE, f"cannot read its container: {error}", host=host.name)

        return look


def ranks_installed(state: State, group: GroupRun, service: str) -> VerifyOutcome | None:
    """A failed verdict when a rank's container is not what this run installed: the head proves only they joined."""
    for name in group.member.hosts[1:]:
        pending = run_context(state).host(name).ledger.pending
        if pending is None:
            continue
        try:
            container = transport_from_pyinfra_host(state.inventory.get_host(name)).container(service)
        except TransportError as error:
            return VerifyOutcome(passed=False, failed=f"misconfigured: {name}: cannot read its container: {error}")
        problem = installed_problem(pending.version, container)
        if problem:
            return VerifyOutcome(passed=False, failed=f"misconfigured: {name}: {problem}")
    return None
