"""The screenshot window's pure parts (tiderl.core.segments) and the training segments a
trajectory with restart turns becomes (Trajectory.segments, TrainSample.from_trajectory)."""

from __future__ import annotations

import pytest

from tiderl.core.config import ConfigError
from tiderl.core.segments import ImageWindow, drop_images, segment_id, task_of
from tiderl.core.types import ImageRef, Trajectory, Turn
from tiderl.trainer.sample import TrainSample

S, P, E = 90, 91, 92  # vision start, image pad, vision end


def test_window_rule():
    window = ImageWindow(4, 2)
    assert [window.to_drop(n) for n in range(1, 7)] == [0, 0, 0, 2, 3, 4]
    assert [window.live_after(n) for n in range(1, 8)] == [1, 2, 3, 2, 3, 2, 3]
    for limit, keep in ((4, 4), (4, 0), (3, 5)):
        with pytest.raises(ConfigError, match="0 < keep < limit"):
            ImageWindow(limit, keep)
    assert segment_id("g1.0", 0, 1) == "g1.0" and segment_id("g1.0", 2, 3) == "g1.0#2"
    assert task_of("g1.0#2") == task_of("g1.0") == "g1.0"


def test_drop_images_cuts_the_oldest_with_their_markers():
    ids = [1, S, P, P, E, 2, S, P, E, 3, S, P, P, P, E, 4]
    images = [ImageRef("c", 11, 3, (1, 2, 6)), ImageRef("a", 2, 2, (1, 2, 4)),
              ImageRef("b", 7, 1, (1, 2, 2))]
    out, kept = drop_images(ids, images, 2)
    assert out == [1, 2, 3, S, P, P, P, E, 4]
    assert kept == [ImageRef("c", 4, 3, (1, 2, 6))]
    assert drop_images(ids, images, 0) == (ids, sorted(images, key=lambda i: i.offset))


def test_a_restart_turn_opens_a_segment():
    """Each segment is flattened on its own (its images' offsets into its ids, its loss on its
    own turns' outputs); samples are named ``task#k`` and share the task's advantage."""
    a, b = ImageRef("a", 1, 2, (1, 2, 4)), ImageRef("b", 1, 1, (1, 2, 2))
    turns = [Turn([S, P, P, E, 5], [6, 7], [-0.1, -0.2], 0, (a,)),
             Turn([S, P, E], [8], [-0.3], 1, (b,)),
             # the window dropped image a: the whole pruned context, then the turn's output
             Turn([5, 6, 7, S, P, E], [9], [-0.4], 1, (ImageRef("b", 4, 1, (1, 2, 2)),), True)]
    trajectory = Trajectory("g1.0", "g1", turns, 1.0, {"a": b"png-a", "b": b"png-b"})
    first, second = trajectory.segments()
    assert first.ids == [S, P, P, E, 5, 6, 7, S, P, E, 8]
    assert first.mask == [0] * 5 + [1, 1] + [0] * 3 + [1]
    assert first.images == (a, ImageRef("b", 8, 1, (1, 2, 2)))
    assert second.ids == [5, 6, 7, S, P, E, 9] and second.mask == [0] * 6 + [1]
    assert second.images == (ImageRef("b", 4, 1, (1, 2, 2)),)
    samples = TrainSample.from_trajectory(trajectory, 0.5, trajectory.image_data)
    assert [s.seq_id for s in samples] == ["g1.0#0", "g1.0#1"]
    assert [s.advantage for s in samples] == [0.5, 0.5]
    assert [dict(s.image_data) for s in samples] == [{"a": b"png-a", "b": b"png-b"},
                                                     {"b": b"png-b"}]
    assert samples[1].logprobs == (0.0,) * 6 + (-0.4,) and samples[1].version == 1
    with pytest.raises(ValueError, match="2 segments"):
        trajectory.flatten()
    with pytest.raises(ValueError, match="no pixels for images"):
        TrainSample.from_trajectory(trajectory, 0.5, {"a": b"png-a"})
