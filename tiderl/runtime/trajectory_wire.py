"""Turns, images and training samples in the bus's shapes and back: what the rank daemon sends
and the coordinator files (torch-free, so the coordinator imports it too)."""

from __future__ import annotations

from collections.abc import Sequence

from tiderl.core.types import ImageRef, Turn
from tiderl.runtime.bus import ImageRefData, TrainSampleData, TurnData
from tiderl.trainer.sample import TrainSample


def image_data(images: Sequence[ImageRef]) -> list[ImageRefData]:
    return [ImageRefData(key=i.key, offset=i.offset, num_tokens=i.num_tokens, grid=i.grid)
            for i in images]


def images_of(data: Sequence[ImageRefData]) -> tuple[ImageRef, ...]:
    return tuple(ImageRef(i.key, i.offset, i.num_tokens, tuple(i.grid)) for i in data)


def turn_data(turn: Turn) -> TurnData:
    return TurnData(context_ids=list(turn.context_ids), output_ids=list(turn.output_ids),
                    logprobs=list(turn.logprobs), version=turn.version,
                    images=image_data(turn.images), restart=turn.restart)


def turn_of(data: TurnData) -> Turn:
    return Turn(data.context_ids, data.output_ids, data.logprobs, data.version,
                images_of(data.images), data.restart)


def sample_data(s: TrainSample) -> TrainSampleData:
    return TrainSampleData(seq_id=s.seq_id, input_ids=list(s.input_ids),
                           loss_mask=list(s.loss_mask), logprobs=list(s.logprobs),
                           advantage=s.advantage, version=s.version,
                           images=image_data(s.images), image_data=dict(s.image_data))


def sample_of(data: TrainSampleData) -> TrainSample:
    return TrainSample(data.seq_id, tuple(data.input_ids), tuple(data.loss_mask),
                       tuple(data.logprobs), data.advantage, data.version,
                       images_of(data.images), data.image_data)
