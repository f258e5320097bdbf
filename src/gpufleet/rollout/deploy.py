"""The old name of gpufleet.rollout.deploy_run, for gpufleet.cli.deploy's import."""

from gpufleet.rollout.deploy_run import pyinfra_command as pyinfra_command
