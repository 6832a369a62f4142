"""A two-rank DDP or FSDP2 step of an HF causal LM of another architecture (the tiny Llama
folder of tests/tiny_llama.py) trains what one process trains. One spawned group runs both
backends; the in-process checks of the model are in tests/unit/test_hf_causal.py (not imported
here: each rank process imports this module, and that one would bring a job's worth of it)."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_llama import write_tiny_llama
from tiderl.models.hf_causal import HFCausalLM, load_hf_causal
from tiderl.models.vocab import VOCAB
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.spawn import RankContext, run_ranks

BACKENDS = ("ddp", "fsdp2")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of the word-level vocabulary (the folder's tokenizer), each its own loss span;
    row 1 ends early (padding after it)."""
    ids = torch.randint(0, len(VOCAB), (3, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(3, 12, dtype=torch.long)
    mask[0, 4:12] = 1
    mask[1, 2:7] = 1
    mask[2, 9:11] = 1
    return ids, mask


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _step(model: HFCausalLM, backend: str, parts: list[tuple[torch.Tensor, torch.Tensor]],
          total_tokens: int) -> dict[str, torch.Tensor]:
    wrapped = make_backend(backend, model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for ids, mask in parts:
        with wrapped.grad_sync(True):
            loss = -(wrapped.logprobs(ids, mask) * mask).sum() / total_tokens
            loss.backward()
    wrapped.reduce_gradients()
    scale = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    for param in wrapped.parameters():  # the group averaged: a sum over the whole batch
        param.grad.mul_(scale)
    optimizer.step()
    return {k: v.detach().clone() for k, v in wrapped.full_state_dict().items()}


def _rank(ctx: RankContext, folder: str) -> dict[str, dict[str, torch.Tensor]]:
    """Rank 0 takes rows 0 and 1 of the batch, rank 1 row 2; each backend on a fresh model."""
    ids, mask = batch()
    rows = [0, 1] if ctx.rank == 0 else [2]
    return {backend: _step(load_hf_causal(folder), backend, [(ids[rows], mask[rows])],
                           int(mask.sum()))
            for backend in BACKENDS}


@pytest.fixture(scope="module")
def ranks(folder) -> list[dict[str, dict[str, torch.Tensor]]]:
    return run_ranks(_rank, 2, str(folder), timeout_s=120)  # one group for both backends


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_rank_step_of_an_hf_model_equals_one_process_step(folder, ranks, backend):
    ids, mask = batch()
    want = _step(load_hf_causal(folder), "ddp", [(ids, mask)], int(mask.sum()))
    for rank in ranks:
        state = rank[backend]
        assert state.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(state[name], want[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
