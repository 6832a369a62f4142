"""Embedded rollout engine and clients for vLLM / SGLang servers."""
