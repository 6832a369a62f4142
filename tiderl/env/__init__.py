"""Environment protocol, server, client and built-in environments."""
