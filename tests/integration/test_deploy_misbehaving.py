"""A converge whose new image's server misbehaves (answers that are not vLLM's, or that fail its clients while
/health, /v1/models and /metrics look fine) is rolled back like any failed verification: one line naming the check
and its evidence, the previous version serving again, the version marked failed, no traceback (real test host, SSH).
Afterwards a plain converge changes nothing, and the failed version asked for again is refused before any change.

One fresh host, steps in file order: good image -> `models-not-json` (/health 200, /v1/models an HTML page) ->
`not-http` (another protocol on the port) -> `completions-fail` (every completion answers 500) -> `stream-broken` (a
streamed completion breaks off in a chunk that does not parse) -> `cache-corrupt` (answers change once the prefix is
cached) -> `tools-broken` (tool calls come back as text), each rolled back to the good image.
"""

from __future__ import annotations

import json
import re

import pytest

from gpufleet.health import HealthState
from tests.integration.pyinfra_results import changed_ops, changes
from tests.integration.test_deploy_qwen35 import SERVICE, STATE_FILE, running_image, sh
from tests.integration.test_deploy_rollback import (  # noqa: F401  fixtures: one fresh host, converge(tag), its good digest
    API_KEY,
    DATA,
    UNIT,
    good,
    health_over_ssh,
    host,
    kept_unit,
    run,
)


@pytest.fixture(scope="module")
def data() -> dict:
    """A short soak: each image here is caught by a check, not by watching it (test_deploy_rollback proves the soak)."""
    return {**DATA, "vllm_ready_soak_s": 3}


@pytest.mark.parametrize(
    ("tag", "caught", "check"),
    [
        ("models-not-json", "/v1/models is not JSON: <html><head><title>502 Bad Gateway</title>", None),
        ("not-http", "GET /health: the port does not answer HTTP: -ERR unknown command 'GET'", None),
        ("completions-fail", "answers: completion: POST /v1/chat/completions answered 500: ", "completion"),
        ("stream-broken", "answers: stream: POST /v1/chat/completions: not an OpenAI stream chunk: ", "stream"),
        # Serving checks (gpufleet_verify_checks, on by default): up, answering, and wrong.
        ("cache-corrupt", "check cached-cold: the cached answer differs from the cold one: token ", "cached-cold"),
        (
            "tools-broken",
            'check tools: tool_choice "required": no parsed tool call; the text was \'<tool_call>',
            "tools",
        ),
    ],
    ids=["models-not-json", "not-http", "completions-fail", "stream-broken", "cache-corrupt", "tools-broken"],
)
def test_an_image_whose_server_misbehaves_is_rolled_back(good, run, host, fleet, tag, caught, check):
    out, rc, _ = run(tag)
    assert rc != 0, out[-4000:]
    assert "Traceback" not in out and "Unexpected error" not in out, out[-4000:]
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith(f"{host.name}: new image ")]
    assert len(lines) == 1, out[-4000:]
    assert re.search(
        rf"failed verification \(misconfigured: {re.escape(caught)}.*\); rolled back to "
        rf"{re.escape(good)}, which is ready \(fix: ",
        lines[0],
    ), lines[0]
    assert API_KEY not in out
    # Serving the previous digest again, through the same checks the deploy uses.
    assert sh(fleet, host, f"systemctl is-active {SERVICE}").strip() == "active"
    assert running_image(fleet, host) == good
    assert fleet.read_file(host, UNIT) == kept_unit(fleet, host)  # the kept unit is the one restored
    assert health_over_ssh(host, fleet)[0] is HealthState.READY
    doc = json.loads(fleet.read_file(host, STATE_FILE))
    assert doc["committed"]["ref"] == good and doc["pending"] is None
    assert doc["failed"][-1]["reason"].startswith(f"misconfigured: {caught}")
    assert doc["failed"][-1].get("check") == check  # the check it failed, for the rollout's table and history

    # At rest: the committed version again changes nothing; the failed one asked for again is refused untouched.
    pid = sh(fleet, host, f"systemctl show -p MainPID --value {SERVICE}").strip()
    out, rc, _ = run("good")
    assert rc == 0 and changes(out) == 0, changed_ops(out)
    out, rc, _ = run(tag)
    assert rc != 0 and "gpufleet_retry_failed=true" in out and "nothing was changed" in out, out[-3000:]
    assert sh(fleet, host, f"systemctl show -p MainPID --value {SERVICE}").strip() == pid
    assert running_image(fleet, host) == good
