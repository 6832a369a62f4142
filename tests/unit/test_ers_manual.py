"""Manual ERS plans (``tiderl rebalance``): which ranks move for the requested counts, and the
refusals. Layouts are strings, one letter a rank: R rollout, A actor, F reF, I idle."""

from __future__ import annotations

from itertools import product

import pytest

from tiderl.core.ers import ERSPolicy, ERSState
from tiderl.core.ers_manual import manual_placement, manual_plan, manual_refusal
from tiderl.core.types import Placement, PlanReason, Role, RoleChange

ROLES = {"R": Role.ROLLOUT, "A": Role.ACTOR, "F": Role.REF, "I": Role.IDLE}
LETTERS = {role: letter for letter, role in ROLES.items()}
COL, DEC = Placement.COLOCATED, Placement.DECOUPLED


def roles(layout: str) -> tuple[Role, ...]:
    return tuple(ROLES[c] for c in layout)


def after(layout: str, rollout: int, trainer: int, placement: Placement | None = None,
          current: Placement = COL) -> str:
    plan = manual_plan(roles(layout), rollout, trainer, placement, current, batch_size=8)
    new = list(roles(layout))
    for change in plan.changes:
        assert new[change.rank] is change.src
        new[change.rank] = change.dst
    return "".join(LETTERS[role] for role in new)


@pytest.mark.parametrize(("layout", "rollout", "trainer", "placement", "expected"), [
    ("RAA", 2, 1, None, "RAR"),  # the highest actor leaves
    ("RAR", 1, 2, None, "RAA"),  # the highest rollout rank joins
    ("RAR", 2, 1, None, "RAR"),  # already so: nothing moves
    ("RAA", 1, 2, DEC, "RAF"),  # no joiner: the highest actor becomes the Ref
    ("RAR", 1, 2, DEC, "RAF"),  # the joining rank becomes the Ref
    ("RFA", 2, 1, None, "RRA"),  # a Ref leaves before any actor
    ("RFA", 1, 2, COL, "RAA"),  # colocated: the Ref becomes an actor
    ("RFA", 1, 2, DEC, "RFA"),
    ("RFAA", 2, 2, DEC, "RFAR"),  # decoupled keeps its Ref: an actor leaves
    ("RFAA", 2, 2, COL, "RRAA"),
    ("RFFA", 1, 3, DEC, "RFAA"),  # exactly one Ref: the lowest stays
    ("RRRA", 1, 3, DEC, "RAFA"),  # joiners: the highest rollout ranks, the highest is the Ref
    ("RIAA", 2, 1, None, "RIAR"),  # a dead (idle) rank neither counts nor moves
    ("AAAR", 3, 1, None, "ARRR"),  # the lowest actor keeps its role
])
def test_manual_plan_moves_the_fewest_ranks_it_can(layout, rollout, trainer, placement, expected):
    assert after(layout, rollout, trainer, placement) == expected


def test_a_manual_plan_is_data_with_reason_manual():
    plan = manual_plan(roles("RAA"), 2, 1, None, COL, batch_size=8)
    assert plan.changes == (RoleChange(2, Role.ACTOR, Role.ROLLOUT),)
    assert (plan.placement, plan.batch_size, plan.reason) == (COL, 8, PlanReason.MANUAL)
    assert PlanReason.MANUAL.value == "manual"


def test_without_a_mode_the_current_one_stays_where_the_trainer_can_run_it():
    assert manual_placement(None, DEC, 2) is DEC
    assert manual_placement(None, DEC, 1) is COL
    assert manual_placement(COL, DEC, 3) is COL
    assert after("RFA", 1, 2, None, current=DEC) == "RFA"
    assert after("RAA", 1, 2, None, current=DEC) == "RAF"
    assert after("RFA", 2, 1, None, current=DEC) == "RRA"  # one trainer rank: colocated


@pytest.mark.parametrize(("layout", "rollout", "trainer", "placement", "reason"), [
    ("RAA", 3, 1, None, "--rollout 3 + --trainer 1 = 4, but the job has 3 live ranks"),
    ("RAA", 1, 1, None, "= 2, but the job has 3 live ranks"),
    ("RIAA", 2, 2, None, "= 4, but the job has 3 live ranks"),
    ("RAA", 0, 3, None, "--rollout 0: at least one rollout rank is needed"),
    ("RAA", 3, 0, None, "--trainer 0: at least one trainer rank is needed"),
    ("RA", 1, 1, DEC, "decoupled needs at least 2 trainer ranks (a Ref and an Actor), "
                      "got --trainer 1"),
    ("RFI", 1, 1, None, "no actor rank is left to hold the weights"),
])
def test_impossible_plans_are_refused_with_one_line(layout, rollout, trainer, placement, reason):
    refusal = manual_refusal(roles(layout), rollout, trainer, placement)
    assert refusal is not None and reason in refusal and "\n" not in refusal
    with pytest.raises(ValueError) as info:
        manual_plan(roles(layout), rollout, trainer, placement, COL, batch_size=8)
    assert str(info.value) == refusal


def _layouts(max_ranks: int):
    for n in range(2, max_ranks + 1):
        for letters in product("RAFI", repeat=n):
            layout = "".join(letters)
            if "A" in layout:  # a running job always has an actor
                yield layout


def test_every_accepted_plan_keeps_the_invariants():
    """Exhaustive over small layouts: the counts come out, IDLE ranks stay, colocated has no
    Ref and decoupled exactly one, and some actor keeps its role (the broadcast's source)."""
    num_plans = 0
    for layout in _layouts(5):
        num_live = len(layout) - layout.count("I")
        for trainer, placement, current in product(range(0, num_live + 1), (None, COL, DEC),
                                              (COL, DEC)):
            rollout = num_live - trainer
            if manual_refusal(roles(layout), rollout, trainer, placement) is not None:
                continue
            new = after(layout, rollout, trainer, placement, current)
            num_plans += 1
            assert new.count("R") == rollout and len(new) - new.count("R") - new.count("I") \
                == trainer
            assert [i for i, c in enumerate(new) if c == "I"] == \
                [i for i, c in enumerate(layout) if c == "I"]
            chosen = manual_placement(placement, current, trainer)
            assert new.count("F") == (1 if chosen is DEC else 0)
            assert any(old == "A" == now for old, now in zip(layout, new, strict=True))
    assert num_plans > 1000


def test_reset_forgets_the_hysteresis_and_a_saved_phase():
    policy = ERSPolicy()
    policy.state = ERSState(saved_roles=roles("RAA"), saved_placement=COL)
    policy.reset()
    assert policy.state == ERSState()
