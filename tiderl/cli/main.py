"""The `tiderl` command: wires the command groups; each lives in its own module.

Help is click's plain formatter (``rich_markup_mode=None``, which every group below inherits):
it rewraps each docstring paragraph to the terminal and shows a boolean flag as a bare flag.
The command modules import their libraries inside the commands, so ``tiderl --help`` loads no
torch, ZeroMQ or SSH client (``tests/integration/test_cli_help.py`` checks it).
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Sequence

import typer

from tiderl import __version__
from tiderl.cli import bench, engine, env, jobs, launch, measure, model, rebalance, sim, top
from tiderl.cli.errors import EXIT_FAILURE, EXIT_USAGE, CLIError
from tiderl.cli.output import Output
from tiderl.core.config import ConfigError  # a ProfileError is one too

app = typer.Typer(
    name="tiderl",
    help="TideRL: readiness-aware elastic RL for multi-turn LLM agents (CTB, RA2P, ERS).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        Output().console.print(f"tiderl {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Global options; ``--debug`` is read by :func:`main` before parsing."""


app.command("launch")(launch.launch)
app.command("top")(top.top)
app.command("status")(jobs.status)
app.command("logs")(jobs.logs)
app.command("stop")(jobs.stop)
app.command("rebalance")(rebalance.rebalance)
app.add_typer(measure.app, name="measure")
app.add_typer(measure.app, name="profile", hidden=True)  # its old name
app.add_typer(bench.app, name="bench")
app.command("sim")(sim.sim)
app.add_typer(env.app, name="env")
app.add_typer(engine.app, name="engine")
app.add_typer(model.app, name="model")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; every error becomes one line on stderr and an exit code, never a traceback
    (unless ``--debug`` or ``TIDERL_DEBUG=1``). Run as the program (``argv`` None: the
    process exits next), it spares the exit its last garbage collections over every object a
    command made (about 0.5 s of CPU after one that loaded torch); atexit handlers still run."""
    try:
        return _main(argv)
    finally:
        if argv is None:
            gc.freeze()


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("TIDERL_DEBUG") == "1"
    command = typer.main.get_command(app)
    try:
        command.main(args=args, prog_name="tiderl", standalone_mode=False)
    except typer.Exit as exc:
        return exc.exit_code
    except typer.TyperException as exc:  # the parser's: bad usage, or a bare group
        return _parser_error(exc, debug)
    except (typer.Abort, KeyboardInterrupt):
        return _fail("interrupted", 130, debug)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE, debug)
    except CLIError as exc:
        return _fail(str(exc), exc.exit_code, debug)
    except Exception as exc:  # a bug or an environment failure: still one line
        return _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILURE, debug)
    return 0


def _parser_error(exc: typer.TyperException, debug: bool) -> int:
    """Typer (0.29) vendors click and exports only the base of its exceptions, so they are told
    apart the way Typer itself does: a bare group raises ``NoArgsIsHelpError`` with the group's
    help as its message; a usage error has ``exit_code`` 2 and the context it happened in."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        sys.stdout.write(exc.format_message() + "\n")
        return 0
    ctx = getattr(exc, "ctx", None)
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    return _fail(f"{exc.format_message()}{hint}", exc.exit_code, debug)


def _fail(message: str, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    Output.error(message.splitlines()[0] if message else "failed")
    return code


if __name__ == "__main__":
    sys.exit(main())
