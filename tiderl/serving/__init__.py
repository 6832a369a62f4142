"""What TideRL's HTTP servers share below their routes: :mod:`.limits` (the bounds on a
connection, a config section of each server) and :mod:`.uvicorn_server` (uvicorn run with them)."""
