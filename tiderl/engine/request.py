"""One generation request (one turn of a task) inside the embedded engine.

Lifecycle::

    WAITING --schedule--> RUNNING --max_tokens / eos--> FINISHED
                           |   ^
                   preempt |   | schedule again (recompute from the prefix cache)
                           v   |
                         PREEMPTED   (back at the front of the waiting queue)

Any unfinished request can also be aborted (FINISHED with reason ABORT).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from tiderl.core.types import ImageRef

if TYPE_CHECKING:
    from tiderl.engine.multimodal import PromptImages

# images among a prompt's ids, with their PNG bytes (None: named by key alone, its bytes sent
# before; the engine then raises ImagesMissing where it no longer holds the image)
Images = Sequence[tuple[ImageRef, bytes | None]]


class RequestStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # in the waiting queue again, its KV freed
    FINISHED = "finished"


class FinishReason(str, Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # eos or a stop token sampled
    ABORT = "abort"


_TRANSITIONS = {
    RequestStatus.WAITING: (RequestStatus.RUNNING, RequestStatus.FINISHED),
    RequestStatus.RUNNING: (RequestStatus.PREEMPTED, RequestStatus.FINISHED),
    RequestStatus.PREEMPTED: (RequestStatus.RUNNING, RequestStatus.FINISHED),
    RequestStatus.FINISHED: (),
}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # besides the engine's eos token

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens: expected a positive number, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: expected >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p}")


@dataclass(slots=True, eq=False)
class Request:
    """A turn: ``prompt_token_ids`` is the task's whole context so far; outputs are appended.

    ``num_computed_tokens`` counts leading tokens whose KV is in the cache (hit or computed);
    ``block_ids`` is the block table, written only by the KV cache manager. ``images``: the
    prompt's images, with their embeddings and multimodal positions (a model that reads images:
    :mod:`tiderl.engine.multimodal`).
    """

    request_id: str
    task_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit tokens at first admission
    images: PromptImages | None = None
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs so far: the tokens whose KV the next step needs."""
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def set_status(self, status: RequestStatus) -> None:
        if status not in _TRANSITIONS[self.status]:
            raise ValueError(f"request {self.request_id}: {self.status.value} -> {status.value}")
        self.status = status

    def append_output(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.all_token_ids.append(token_id)
