"""The README's GPU-less path works exactly as written: `gpufleet sandbox up && pyinfra inventories/sandbox.py
deploys/qwen35.py` converges a local simulated fleet, a second run changes nothing, and `gpufleet verify` passes.

It uses the real sandbox (bridge gf-sandbox, /var/lib/gpufleet/sandbox) and takes it down at the end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.pyinfra_results import changed_ops, changes, results

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def readme_sandbox_command() -> str:
    readme = (REPO / "README.md").read_text()
    match = re.search(r"No GPUs at hand\?.*?```bash\n(.*?)\n```", readme, re.S)
    assert match, "README lost its sandbox block"
    return match.group(1).strip()


def test_readme_sandbox_command_converges_as_written():
    if os.geteuid() != 0:
        pytest.skip("the sandbox needs root")
    command = readme_sandbox_command()
    assert command == "gpufleet sandbox up && pyinfra inventories/sandbox.py deploys/qwen35.py"
    # The README's commands run inside the activated venv: put its bin first, as `. .venv/bin/activate` does.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("GPUFLEET_SANDBOX_DIR", None)

    def sh(line: str, timeout: float = 900) -> subprocess.CompletedProcess:
        # Enter answers pyinfra's "Press enter to execute..." prompt, as a person would.
        return subprocess.run(
            ["bash", "-c", line], cwd=REPO, env=env, input="\n", text=True, capture_output=True, timeout=timeout
        )

    try:
        first = sh(command)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        verify = sh("gpufleet verify inventories/sandbox.py")
        assert verify.returncode == 0, verify.stdout + verify.stderr
        again = sh("pyinfra -y inventories/sandbox.py deploys/qwen35.py")
        assert again.returncode == 0, again.stderr[-3000:]
        # Every operation on every host reported "no change": nothing was executed.
        assert changes(again.stdout + again.stderr) == 0, changed_ops(again.stdout + again.stderr)
        assert results(again.stdout + again.stderr)["Grand total"][2] == "-"  # and nothing failed
    finally:
        down = sh("gpufleet sandbox down")
        assert down.returncode == 0, down.stderr
