"""What gpufleet keeps on a host about the versions it ran: the ledger (a pure state machine), where it and the
committed units live (paths), and the one reader that the deploy and the rollout share."""
