"""`gpufleet sandbox`: a local simulated GPU fleet to try the deploy on, and GPU faults for it (docs/test-hosts.md)."""

from __future__ import annotations

from datetime import datetime

import click

from gpufleet.sandbox import gpu_faults
from gpufleet.sandbox.config import NO_GPU, H200x3, sandbox_config
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.procs import SandboxError


@click.group()
def sandbox() -> None:
    """Start and stop a local simulated GPU fleet (root + systemd-nspawn)."""


@sandbox.command()
@click.argument("count", type=click.IntRange(1, 200), default=2)
@click.option(
    "--routers",
    type=click.IntRange(0, 8),
    default=0,
    show_default=True,
    help="Also boot this many GPU-less hosts in the routers inventory group (deploys/router.py).",
)
@click.option(
    "--site-cache",
    is_flag=True,
    help="Put gpuhost1 in the site_cache inventory group: it runs the site's pull-through registry "
    "cache and the other hosts pull through it (docs/site-cache.md).",
)
def up(count: int, routers: int, site_cache: bool) -> None:
    """Boot COUNT hosts (gpuhost1..COUNT, each 3x H200) and write the inventory inventories/sandbox.py reads.

    An earlier sandbox (even one whose run was killed) is cleared first."""
    fleet = Fleet(sandbox_config())
    try:
        fleet.start()
        hosts = fleet.add_hosts([H200x3] * count)
        if routers:
            hosts += fleet.add_hosts([NO_GPU] * routers, role="router")
        inventory = fleet.write_inventory(site_cache=(hosts[0].name,) if site_cache else ())
    except SandboxError as err:
        raise click.ClickException(str(err)) from None
    for h in hosts:
        role = "router" if h.role == "router" else f"{h.gpus.count}x {h.gpus.model}"
        click.echo(f"{h.name}\t{h.ip}\t{role}" + (", site cache" if site_cache and h is hosts[0] else ""))
    click.echo(f"inventory: {inventory}  (pyinfra inventories/sandbox.py ...)")
    click.echo(f"booted {len(hosts)} host(s); stop with: gpufleet sandbox down")


@sandbox.command()
def down() -> None:
    """Stop every sandbox host and service; leaves no process, mount, netns or link behind (caches stay)."""
    fleet = Fleet(sandbox_config())
    try:
        from gpufleet.sandbox.fleet import check_prerequisites

        check_prerequisites()
        fleet.stop()
    except SandboxError as err:
        raise click.ClickException(str(err)) from None
    click.echo("sandbox down")


@sandbox.command(name="gpu-fault")
@click.argument("host")
@click.option("--gpu", "index", type=click.IntRange(min=0), default=0, show_default=True, help="The GPU's index.")
@click.option(
    "--fault",
    "faults",
    multiple=True,
    type=click.Choice(list(gpu_faults.FAULTS)),
    help="What its nvidia-smi then reports for the GPU (repeatable).",
)
@click.option(
    "--xid",
    "xids",
    multiple=True,
    type=click.IntRange(min=1),
    help="An Xid of this code on the GPU in the host's kernel log (repeatable).",
)
@click.option("--at", default=None, metavar="TIME", help="When the Xid lines were logged: ISO 8601 (default: now).")
@click.option("--clear", is_flag=True, help="First make every GPU healthy again and empty the kernel log.")
def gpu_fault(
    host: str, index: int, faults: tuple[str, ...], xids: tuple[int, ...], at: str | None, clear: bool
) -> None:
    """Inject a GPU fault into the running sandbox host HOST: nvidia-smi's health fields for GPU N, Xid lines in the
    host's own kernel log (its dmesg). `gpufleet status inventories/sandbox.py` shows the verdict.

    \b
    Example:
        gpufleet sandbox gpu-fault gpuhost2 --gpu 1 --xid 79
        gpufleet sandbox gpu-fault gpuhost3 --fault thermal
        gpufleet sandbox gpu-fault gpuhost2 --clear
    """
    fleet = Fleet(sandbox_config())
    try:
        root = fleet.host(host).root
    except StopIteration:
        raise click.ClickException(f"{host}: no such sandbox host (fix: `gpufleet sandbox up` lists them)") from None
    try:
        when = None if at is None else datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
        if clear:
            gpu_faults.clear(root)
        for fault in faults:
            gpu_faults.inject(root, index, fault)
        for code in xids:
            for line in gpu_faults.log_xid(root, index, code, at=when):
                click.echo(f"{host}: kernel log: {line}")
    except (ValueError, IndexError, OSError) as err:
        raise click.ClickException(f"{host}: {err or type(err).__name__} (fix: check --gpu and --at)") from None
    for fault in faults:
        click.echo(f"{host}: GPU {index}: {fault}")
