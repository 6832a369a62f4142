"""Discrete-event cluster simulator driving the core policies."""
