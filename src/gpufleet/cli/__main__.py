from gpufleet.cli import main

main(prog_name="gpufleet")
