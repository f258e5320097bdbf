"""What gpufleet keeps on a host about the versions it ran.

    ledger     the ledger, a pure state machine
    paths      where it and the committed units live
    atomic     replacing a root file whole
    reader     the one reading of a host's ledgers
    sections   the marked parts of a one-command read
    rules      which ledger a service goes by
"""
