"""What every slice's operations share (docs/architecture.md, "The deploy's seams").

base     what an operation yields; failing a host on one line
files    files written atomically, by checksum
secret   secrets pyinfra never prints
run      the run's state, per host and run-wide
"""
