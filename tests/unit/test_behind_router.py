"""A router in front of the replicas (a `routers` group in the inventory) gives each replica's vLLM the flags the
router's default policy needs (gpufleet.vllm.settings.BEHIND_ROUTER_ARGS), in every view of the inventory alike."""

from __future__ import annotations

from click.testing import CliRunner

from gpufleet.cli import main
from gpufleet.vllm.host_specs import load_specs
from gpufleet.vllm.settings import BEHIND_ROUTER_ARGS, build_spec
from tests.unit.test_cli_render import inventory  # noqa: F401 - the fixture

WITH_ROUTER = """
    gpuhosts = [("gpu1", {"ssh_hostname": "10.0.0.11"}), ("gpu2", {"ssh_hostname": "10.0.0.12", "vllm_args": {
        "enable-scale-out": None}})]
    routers = [("router1", {"ssh_hostname": "10.0.0.5"})]
"""
ALONE = """
    gpuhosts = [("gpu1", {"ssh_hostname": "10.0.0.11"})]
"""


def test_replicas_behind_a_router_take_its_flags_and_a_host_may_leave_them_out(inventory):
    assert BEHIND_ROUTER_ARGS == {"enable-scale-out": True}
    specs = {spec.host: spec for spec in load_specs(inventory(WITH_ROUTER))}
    assert specs["gpu1"].arg("enable-scale-out") is True and "--enable-scale-out" in specs["gpu1"].vllm_argv()
    assert specs["gpu2"].arg("enable-scale-out") is None  # removed on purpose in its vllm_args
    rendered = CliRunner().invoke(main, ["render", inventory(WITH_ROUTER), "--host", "gpu1"])
    assert rendered.exit_code == 0 and "--enable-scale-out" in rendered.output


def test_without_a_router_nothing_is_added(inventory):
    [spec] = load_specs(inventory(ALONE))
    assert spec.arg("enable-scale-out") is None
    assert spec.spec_hash != build_spec("gpu1", {"ssh_hostname": "10.0.0.11"}, behind_router=True).spec_hash
