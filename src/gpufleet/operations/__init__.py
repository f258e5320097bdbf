"""pyinfra operations every slice shares; each slice's own operations take arguments and yield commands or a no-op.

    base     what an operation yields, and failing a host on one line
    files    files written atomically and by checksum
    secret   secrets pyinfra never prints
    run      the run's own state, per host and run-wide
"""
