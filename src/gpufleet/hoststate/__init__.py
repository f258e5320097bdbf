"""What gpufleet keeps on a host about the versions it ran (docs/crash-safety.md).

ledger     the ledger's state machine
paths      where state lives
atomic     replacing a root file whole
reader     reading a host's ledgers
sections   a command's marked output
rules      which ledger a service goes by
"""
