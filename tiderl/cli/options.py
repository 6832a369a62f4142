"""Options that several commands share: the profile every daemon and job reads."""

from __future__ import annotations

import typer

# tiderl.profile.DEFAULT_PROFILE, written out so that --help imports no profile code
ProfileOpt = typer.Option("local", "--profile", "-p",
                          help="Profile name in profiles/ or a path to a YAML file.")
SetOpt = typer.Option(None, "--set", "-s", metavar="KEY=VALUE",
                      help="Override one profile value, e.g. ctb.budget_fraction=0.8 or a list, "
                           "'logging.backends=[jsonl,tensorboard]' (repeatable).")
