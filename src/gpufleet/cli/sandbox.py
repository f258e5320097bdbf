"""`gpufleet sandbox up [N]` / `gpufleet sandbox down`: a local simulated GPU fleet to try the deploy on.

Hosts are systemd-nspawn containers on bridge gf-sandbox (10.213.0.0/24) with sshd, sudo, apt and GPU stand-ins;
the local mirror, the stand-in NVIDIA and Docker repos and the registry listen on 10.213.0.1 only. Needs root and systemd-nspawn.
"""

from __future__ import annotations

import click

from gpufleet.sandbox.config import NO_GPU, H200x3, sandbox_config
from gpufleet.sandbox.fleet import Fleet
from gpufleet.sandbox.procs import SandboxError


@click.group()
def sandbox() -> None:
    """Start and stop a local simulated GPU fleet (root + systemd-nspawn)."""


@sandbox.command()
@click.argument("count", type=click.IntRange(1, 200), default=2)
@click.option("--routers", type=click.IntRange(0, 8), default=0, show_default=True,
              help="Also boot this many GPU-less hosts in the inventory's routers group (deploys/router.py).")
@click.option("--site-cache", is_flag=True,
              help="Put gpuhost1 in the inventory's site_cache group: it runs the site's pull-through registry "
                   "cache and the other hosts pull through it (docs/site-cache.md).")
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
