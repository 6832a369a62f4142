"""Agents to copy: the ``calc`` task written against the OpenAI and Anthropic APIs, in this
process and as a command line (see docs/agents.md)."""
