"""Launch plans and executors (local processes, SSH)."""
