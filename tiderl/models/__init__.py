"""Qwen2-architecture model shared by the engine and the trainer."""
