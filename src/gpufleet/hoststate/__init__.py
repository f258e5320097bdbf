"""What gpufleet keeps on a host about the versions it ran: the ledger (a pure state machine), where it and the
committed units live (paths), how its files are replaced (atomic), the one reading of a host's ledgers that the
deploy and the rollout share (reader), the marked sections a one-command read prints (sections), and which ledger a
service goes by (rules: a renamed service takes over the one on its port)."""
