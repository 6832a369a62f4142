"""Coordinator, rank daemons and the ZeroMQ bus."""
