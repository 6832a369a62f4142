"""The step cycle: one pure object that feeds CTB, RA2P and ERS and runs the boundary, driven by
both the simulator (an event heap) and the runtime coordinator (a bus).

    adapter ──events (time is an argument)──> StepController ──commands (tiderl.core.commands)──>
      its parts (each owns its state; none calls another):
          CycleState        phase, hold, step, version, roles, dead ranks          (.state)
          RolloutControl    TaskBook + CTB or request-level policy, footprints, RWT (.rollout)
          ReadyBuffer       ready groups -> micro-batches of batch s (BufferEvents) (core.buffer)
          ERSPolicy         layouts, RA2P placements, batches                   (core.ers)
          TrainingFeed      groups out up to the staleness throttle                (.feed)
          Evaluation        evaluation phases                                      (.evaluation)
          Boundaries        the boundary out and its acknowledgements              (.boundary)
          StepRunner        the open step, micro-batches waiting for theirs        (.steps)
          Ledger            step records and totals                                (.ledger)
          ManualPlans       an operator's pending plan and held layout             (.manual)
          faults            what a death means, how a step it hit ended            (.faults)

    launch ─(ERS: launch plan, Boundary v0)─┐
                                            v
      ┌─> BOUNDARY ──every member acked──> WAITING ──batch s complete──┐   whole-batch systems
      │    rollout members acked: Retire, Feed └──────streaming──────┴──> TRAINING (step s)
      │                                                                      │ StepOutcome
      └── Boundary v = s+1 (manual plan | ERS plan | same roles) <── RecordStep ─┘
                      after the last step: Boundary (final), Finish ──> FINISHED
      holds: COLD_START (launch lent trainer ranks: step 0 waits for batch 0, then a boundary
             brings them back), EVALUATION (a step ended with evaluation groups out: its
             boundary waits for them); the allowed moves are listed in .state

    a trainer rank of step s dies ──> AbortStep; no live actor updated ──> (a boundary without
      an update, v = s) ──> TRAINING (step s again, attempt + 1, its micro-batches)  (.faults)

Invariant: step s opens only once every live rank acknowledged the boundary before it, and the
staleness window moves only once every rollout rank has the new version (a task admitted earlier
would start on the old weights and be too stale by the time its batch trains).

A replay (``runtime.replay``) runs :class:`.replay.ReplayController`: a StepController to its
adapter, on the same parts, whose steps are a recording's (no rollout, ERS or RA2P choice).

Every policy input is built in this package and nowhere else: the task footprints CTB packs
(:mod:`.rollout`), the ERS input and RA2P's cost-model inputs, with the pass times learned from
the trainer ranks' reports (:mod:`.inputs`), the step mode, the elastic batch, evaluation
phases and the order of the boundary (:mod:`.controller`), operator plans (:mod:`.manual`) and
the configuration each system runs, with the layout limits every plan goes through
(:mod:`.config`, :func:`effective_config`).
"""


from tiderl.core.step_control.config import (
    LayoutLimits,
    StepControlConfig,
    StepControlError,
    Substrate,
    effective_config,
    effective_ctb,
    effective_view,
    group_of_task,
    initial_roles,
    task_id,
)
from tiderl.core.step_control.controller import StepController
from tiderl.core.step_control.resume import ResumePoint, restore, resume_point
from tiderl.core.step_control.rollout import RolloutControl, RolloutWait, reusable_tokens
from tiderl.core.step_control.state import Hold, Phase

__all__ = ["Hold", "LayoutLimits", "Phase", "ResumePoint", "RolloutControl", "RolloutWait",
           "StepControlConfig", "StepControlError", "StepController", "Substrate",
           "effective_config", "effective_ctb", "effective_view", "group_of_task",
           "initial_roles", "restore", "resume_point", "reusable_tokens", "task_id"]
