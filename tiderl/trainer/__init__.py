"""GRPO actor and ref workers, RA2P executors, weight sync, checkpoints."""
