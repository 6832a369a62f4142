"""CTB's count of a group's shared prompt (``ctb.share_prompt``): a rank holds the prompt's full
KV blocks once for all of the group's tasks active there, as the engines' prefix caches keep
them; exact books and plans."""

from __future__ import annotations

import pytest

from tiderl.core.ctb import CTBConfig, CTBPolicy, TaskBook
from tiderl.core.step_control.rollout import RolloutControl
from tiderl.core.types import Admit, Group, Pause, Resume, Task


def _book(config: CTBConfig, budgets: dict[int, int], size: int) -> TaskBook:
    book = config.new_book(block_tokens=16)
    for rank, budget in budgets.items():
        book.add_rank(rank, budget)
    book.add_group(Group("g", tuple(Task(f"g{i}", "g", "shop") for i in range(size))))
    return book


def test_a_ranks_usage_counts_its_groups_prompt_once():
    book = _book(CTBConfig(), {0: 10_000, 1: 10_000}, 3)
    book.apply([Admit("g0", 0), Admit("g1", 0)])
    assert book.ranks[0].usage == 512 + 512  # the prompt not known yet: whole footprints
    book.report_turn("g0", 300, 280, prompt_tokens=100)  # 100 tokens: 6 full blocks, 96
    assert book.groups["g"].prompt_tokens == 96
    assert book.ranks[0].usage == 300 + 512 - 96
    book.report_turn("g1", 320, 300, prompt_tokens=100)  # set once
    assert book.ranks[0].usage == 300 + 320 - 96
    book.apply([Pause("g1")])
    assert book.ranks[0].usage == 300  # alone: it holds its whole context
    book.apply([Resume("g1", 0), Admit("g2", 1)])
    assert (book.ranks[0].usage, book.ranks[1].usage) == (300 + 320 - 96, 300)  # g2 alone
    book.finish_task("g0")
    assert book.ranks[0].usage == 320


@pytest.mark.parametrize(("share", "admitted"), [(True, 3), (False, 1)])
def test_siblings_sharing_the_prompt_fit_where_whole_contexts_would_not(share, admitted):
    # g0 holds 400 tokens of a rank of 1,000, 320 of them its prompt; its siblings are admitted
    # at its 400. Counted whole, one more fits (800); sharing the prompt, each adds 80.
    config = CTBConfig(project_growth=False, share_prompt=share)
    book = _book(config, {0: 1000}, 4)
    book.apply([Admit("g0", 0)])
    book.report_turn("g0", 400, 388, prompt_tokens=320)
    plan = CTBPolicy(config).schedule(book)
    assert plan == [Admit(f"g{i}", 0) for i in range(1, 1 + admitted)]
    book.apply(plan)
    assert book.ranks[0].usage == (400 + 3 * 80 if share else 800)


def test_the_rollout_control_takes_a_groups_prompt_from_its_first_turn():
    control = RolloutControl.of(CTBConfig(), budget=10_000, max_new_tokens=12, block_tokens=16)
    control.add_rank(0, 0.0)
    control.add_group(Group("g", (Task("g0", "g", "shop"), Task("g1", "g", "shop"))), 0.0)
    assert control.schedule(0.0) == [Admit("g0", 0)]  # the probe
    control.turn_done("g0", 60, 10, 1.0)  # a prompt of 50 tokens: 3 full blocks
    assert control.book.groups["g"].prompt_tokens == 48
    assert control.schedule(1.0) == [Admit("g1", 0)]
    assert control.book.ranks[0].usage == 2 * (60 + 12) - 48
