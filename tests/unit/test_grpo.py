import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiderl.core.grpo import batch_advantages, group_advantages


def test_two_rewards_give_plus_minus_one():
    adv = group_advantages([0.0, 1.0], eps=0.0)
    assert adv == [-1.0, 1.0]


def test_hand_computed_group_of_four():
    # mean 0.5, population std 0.5
    adv = group_advantages([1.0, 0.0, 1.0, 0.0], eps=1e-6)
    expected = 0.5 / (0.5 + 1e-6)
    assert adv == pytest.approx([expected, -expected, expected, -expected], abs=1e-15)


def test_equal_rewards_give_exact_zeros():
    assert group_advantages([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]
    assert group_advantages([3.0]) == [0.0]


def test_mean_centred_variant_keeps_scale():
    assert group_advantages([2.0, 4.0, 6.0], scale_by_std=False) == [-2.0, 0.0, 2.0]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least one reward"):
        group_advantages([])
    with pytest.raises(ValueError, match="eps"):
        group_advantages([1.0, 2.0], eps=-1.0)


def test_batch_is_per_group():
    assert batch_advantages([[0.0, 1.0], [5.0, 5.0]], eps=0.0) == [[-1.0, 1.0], [0.0, 0.0]]


@given(st.lists(st.integers(-10_000, 10_000).map(lambda x: x / 100), min_size=2, max_size=64))
def test_advantages_are_centred_and_unit_scale(rewards):
    adv = group_advantages(rewards, eps=0.0)
    assert math.fsum(adv) == pytest.approx(0.0, abs=1e-9)
    if any(a != 0.0 for a in adv):
        # population std of the advantages is 1 when eps = 0
        var = math.fsum(a * a for a in adv) / len(adv)
        assert var == pytest.approx(1.0, rel=1e-9)
