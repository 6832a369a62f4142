"""`tiderl launch`: resolve the profile, plan the processes, start the job."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from tiderl.cli.errors import CLIError
from tiderl.cli.output import JsonFlag, Output, table
from tiderl.launch.plan import LaunchPlan, plan_local
from tiderl.profile import DEFAULT_PROFILE, Profile, load_profile, profile_to_dict

ProfileOpt = typer.Option(DEFAULT_PROFILE, "--profile", "-p",
                          help="Profile name in profiles/ or a path to a YAML file.")
SetOpt = typer.Option(None, "--set", "-s", metavar="KEY=VALUE",
                      help="Override one profile value, e.g. ctb.budget_fraction=0.8 (repeatable).")


def launch(
    nodes: Path | None = typer.Option(None, "--nodes", help="hosts.yaml; omit to run here."),
    profile: str = ProfileOpt,
    overrides: list[str] | None = SetOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved profile and plan."),
    json_mode: bool = JsonFlag,
) -> None:
    """Start the rollout and trainer daemons of one job (this machine by default)."""
    if nodes is not None:
        raise CLIError("tiderl launch --nodes: launching over SSH is not built yet")
    resolved = load_profile(profile, overrides or [])
    plan = plan_local(resolved)
    out = Output(json_mode)
    out.result(_payload(resolved, plan), lambda console: _render(console, resolved, plan))
    if not dry_run:
        raise CLIError("tiderl launch: the runtime is not built yet; nothing was started "
                       "(the plan above is what it would run)")


def _payload(profile: Profile, plan: LaunchPlan) -> dict:
    return {
        "profile": profile_to_dict(profile),
        "plan": [
            {"name": p.name, "kind": p.kind, "host": p.host, "rank": p.rank,
             "role": p.role.value if p.role else None, "device": p.device, "threads": p.threads}
            for p in plan.processes
        ],
    }


def _render(console: Console, profile: Profile, plan: LaunchPlan) -> None:
    for section, values in profile_to_dict(profile).items():
        rows = list(_flatten(values))
        console.print(table(section, ("key", "value"), rows))
    rows = [(p.name, p.kind, p.host, p.role.value if p.role else "", p.device or "",
             p.threads or "") for p in plan.processes]
    console.print(table("plan", ("process", "kind", "host", "role", "device", "threads"), rows))


def _flatten(values: dict, prefix: str = ""):
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, list):
            yield f"{prefix}{key}", "[" + ", ".join(map(str, value)) + "]"
        else:
            yield f"{prefix}{key}", value
