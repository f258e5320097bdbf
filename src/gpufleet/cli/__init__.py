"""The `gpufleet` command: a thin click layer over the library. Each command family lives in its own module."""

from __future__ import annotations

import click

from gpufleet import __version__
from gpufleet.cli.deploy import deploy as deploy_command
from gpufleet.cli.init import init as init_command  # keep gpufleet.cli.<name> the module
from gpufleet.cli.logs import NORMAL, QUIET, VERBOSE, set_verbosity
from gpufleet.cli.render import lint, render
from gpufleet.cli.rollout import history_command, rollback, rollout
from gpufleet.cli.sandbox import sandbox
from gpufleet.cli.verify import status
from gpufleet.cli.verify import verify as verify_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="gpufleet")
@click.option("-q", "--quiet", is_flag=True, help="Only the result and the errors: no progress, no summary lines.")
@click.option("-v", "--verbose", is_flag=True, help="More detail: paramiko's and pyinfra's own debug logs on stderr.")
def main(quiet: bool, verbose: bool) -> None:
    """Provision GPU hosts into fast vLLM servers for Qwen 3.5 and keep the fleet current.

    \b
    Start:    gpufleet init fleet --host gpu-box-1=192.168.1.50   (a starter inventory)
    Deploy:   gpufleet deploy fleet/inventory.py   (the main job: converge every host; --dry, --limit HOST, -y)
    Nightly:  gpufleet rollout fleet/inventory.py --yes

    \b
    Exit status: 0 all good, 1 problems found, 2 bad usage or input (docs/cli.md).
    --json (status, verify, history, rollout, rollback): {"command", "ok", "hosts", "routers"}.
    Shell completion: eval "$(_GPUFLEET_COMPLETE=bash_source gpufleet)" (zsh_source, fish_source).
    """
    if quiet and verbose:
        raise click.UsageError("-q and -v ask for opposite things (fix: pass one of them)")
    set_verbosity(QUIET if quiet else VERBOSE if verbose else NORMAL)


for command in (
    init_command,
    deploy_command,
    render,
    lint,
    status,
    verify_command,
    sandbox,
    rollout,
    history_command,
    rollback,
):
    main.add_command(command)
