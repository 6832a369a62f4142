"""`tiderl env serve`: run the environment service alone."""

from __future__ import annotations

import typer

from tiderl.cli.errors import EXIT_USAGE, CLIError, check_port_free
from tiderl.cli.options import count_option, port_option, seconds_option
from tiderl.cli.output import Output
from tiderl.serving.limits import ConnectionLimits

BOUNDS = ConnectionLimits()  # the defaults of the connection options (a light import)

app = typer.Typer(help="The environment service.", no_args_is_help=True)

# EnvConfig's and its ConnectionLimits' fields that `serve` sets, by the option that sets them
OPTIONS = {"envs": "--envs", "max_turns": "--max-turns", "max_sessions": "--max-sessions",
           "idle_ttl_s": "--idle-ttl", "header_timeout_s": "--header-timeout",
           "body_timeout_s": "--body-timeout", "max_per_client": "--max-client-connections"}


@app.command("serve")
def serve(
    envs: str = typer.Option("guess,shop,household,calc,gui", "--envs",
                             help="Environments to serve (built-ins, gym:..., verifiers:..., "
                                  "or a dotted path)."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = port_option(8100),
    max_sessions: int = count_option(256, "--max-sessions", minimum=1,
                                     help="Open sessions at most."),
    idle_ttl: float = seconds_option(600.0, "--idle-ttl", help="Seconds before an idle session "
                                     "expires (paused sessions never do)."),
    max_turns: int = count_option(20, "--max-turns", minimum=1,
                                  help="Turn cap of every episode."),
    gym: str = typer.Option("", "--gym", help="Also serve a gymnasium env as 'gym': "
                            "ENV_ID or module:factory."),
    token: str | None = typer.Option(
        None, "--token", envvar="TIDERL_ENV_TOKEN", show_envvar=True,
        help="Bearer token every route but /health and /metrics requires (default: none)."),
    header_timeout: float = seconds_option(
        BOUNDS.header_timeout_s, "--header-timeout",
        help="A request's headers must arrive within this, else 408 and the connection closed."),
    body_timeout: float = seconds_option(
        BOUNDS.body_timeout_s, "--body-timeout",
        help="Its body within this of the headers, else 408 and the connection closed."),
    max_client_connections: int = count_option(
        BOUNDS.max_per_client, "--max-client-connections", minimum=1,
        help="Connections one client address may hold open; a request on one more gets 503."),
) -> None:
    """Serve /start /observation /end /pause /resume, /health and /metrics over HTTP."""
    from tiderl.core.config import ConfigError
    from tiderl.env.config import EnvConfig

    names = [name.strip() for name in envs.split(",") if name.strip()]
    try:
        connections = ConnectionLimits(header_timeout, body_timeout, max_client_connections)
        config = EnvConfig(envs=names, max_turns=max_turns, max_sessions=max_sessions,
                           idle_ttl_s=idle_ttl, connections=connections)
    except ConfigError as exc:  # named by the option that set it
        option = OPTIONS.get(exc.key.partition("[")[0], "--envs")
        raise CLIError(f"tiderl env serve: {option}: {exc.message}", EXIT_USAGE) from None
    check_port_free("tiderl env serve", host, port)  # before the environments load
    from tiderl.env.base import UnknownEnvironment
    from tiderl.env.registry import make_env
    from tiderl.env.server import serve as serve_app

    for name in names + ([f"gym:{gym}"] if gym else []):
        try:
            make_env(name, max_turns=max_turns)  # fail now, not on the first /start
        except (ConfigError, UnknownEnvironment) as exc:
            option = "--gym" if gym and name == f"gym:{gym}" else "--envs"
            raise CLIError(f"tiderl env serve: {option}: {exc}", EXIT_USAGE) from exc
        except ImportError as exc:  # a missing module or an environment not built yet
            raise CLIError(f"tiderl env serve: {exc}", EXIT_USAGE) from exc
    served = ", ".join(names + (["gym"] if gym else []))
    Output().note(f"tiderl env: {served} on http://{host}:{port} "
                  f"(max {max_sessions} sessions, idle TTL {idle_ttl:g} s)")
    serve_app(config, host, port, gym=gym or None, token=token)
