"""`tiderl rebalance`: a manual ERS plan sent over the bus, applied at the next sync boundary."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer

from tiderl.cli.errors import EXIT_USAGE, CLIError
from tiderl.cli.options import count_option, seconds_option
from tiderl.cli.output import JsonFlag, Output
from tiderl.core.quote import short

PLACEMENTS = ("decoupled", "colocated")
REPLY_TIMEOUT_S = 15.0  # the first answer (accepted or refused) comes within a coordinator round


def rebalance(
    job: str = typer.Argument(..., help="Job id (or the path of its run folder)."),
    rollout: int | None = count_option(None, "--rollout", help="Rollout ranks after the move."),
    trainer: int | None = count_option(None, "--trainer", help="Trainer ranks after the move."),
    placement: str | None = typer.Option(
        None, "--placement", "--mode",
        help="RA2P's placement: decoupled or colocated (default: keep; --mode is an alias)."),
    auto: bool = typer.Option(False, "--auto",
                              help="End a held manual layout: ERS plans again."),
    run_root: Path | None = typer.Option(None, "--run-root", help="Folder of the job folders."),
    timeout: float = seconds_option(300.0, "--timeout", minimum=0.1,
                                    help="Seconds to wait for the plan to be applied."),
    no_wait: bool = typer.Option(False, "--no-wait", help="Return once the plan is accepted."),
    json_mode: bool = JsonFlag,
) -> None:
    """Move ranks between rollout and training by hand; the layout then holds until --auto."""
    from tiderl.launch.rebalance import request_rebalance
    from tiderl.runtime import bus as b

    if auto and (rollout is not None or trainer is not None or placement is not None):
        raise CLIError("tiderl rebalance: --auto takes no --rollout, --trainer or --placement",
                       EXIT_USAGE)
    request = b.Rebalance(seq=1, auto=True) if auto else b.Rebalance(
        seq=1, placement=_check_placement(placement), **_check_counts(rollout, trainer))
    out = Output(json_mode)
    endpoint, keys = _job_bus(job, run_root)
    reply_timeout = min(timeout, REPLY_TIMEOUT_S)
    with contextlib.closing(request_rebalance(
            endpoint, keys, request, reply_timeout_s=reply_timeout, apply_timeout_s=timeout,
            wait=not no_wait)) as replies:
        final = first = next(replies)
        if first is None:
            raise CLIError(f"tiderl rebalance: no answer from the coordinator of job {job} at "
                           f"{endpoint} within {reply_timeout:g} s (is the job running? see "
                           "`tiderl status`)")
        if first.status == "accepted":
            out.note(f"accepted: applies at the next boundary (after step {first.step})")
            final = next(replies, first)
            if final is None:
                raise CLIError(f"tiderl rebalance: accepted, still pending after {timeout:g} s: "
                               f"it applies at the boundary after step {first.step} "
                               "(see events.jsonl)")
    payload = {"job": job, "status": final.status, "reason": final.reason, "step": final.step,
               "version": final.version, "roles": final.roles, "placement": final.placement}
    if final.status == "refused":
        if json_mode:
            out.result(payload)
        raise CLIError(f"tiderl rebalance: refused: {final.reason}")
    out.result(payload, lambda console: console.print(_summary(final), markup=False))


def _check_placement(placement: str | None) -> str:
    if placement is not None and placement not in PLACEMENTS:
        raise CLIError(f"tiderl rebalance: --placement {short(placement)}: expected one of "
                       f"{', '.join(PLACEMENTS)}", EXIT_USAGE)
    return placement or ""


def _check_counts(rollout: int | None, trainer: int | None) -> dict[str, int]:
    if rollout is None or trainer is None:
        raise CLIError("tiderl rebalance: give --rollout N and --trainer M (or --auto)",
                       EXIT_USAGE)
    return {"rollout": rollout, "trainer": trainer}


def _job_bus(job: str, run_root: Path | None):
    from tiderl.launch.local import LaunchError
    from tiderl.launch.run_folders import resolve_job
    from tiderl.runtime.bus import BusKeyError, load_job_keys

    try:
        state = resolve_job(job, run_root)
        keys = load_job_keys(Path(state.run_dir) / "keys", "operator")
    except (LaunchError, BusKeyError) as exc:
        raise CLIError(f"tiderl rebalance: {exc}") from exc
    endpoint = state.info.get("bus")
    if not endpoint:
        raise CLIError(f"tiderl rebalance: job {job} has no bus endpoint in its job.json "
                       "(has its coordinator started?)")
    return endpoint, keys


def _summary(reply) -> str:
    if reply.status == "accepted":  # --no-wait
        return (f"accepted: roles {', '.join(reply.roles)} ({reply.placement}) from the next "
                "boundary")
    if reply.reason:  # --auto
        return reply.reason
    return (f"applied at version {reply.version}: roles {', '.join(reply.roles)} "
            f"({reply.placement}); held until `tiderl rebalance JOB --auto`")
