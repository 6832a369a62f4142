"""Checkpoints: save after 2 AdamW steps, train 2 more; a fresh process group that loads the
checkpoint into a differently initialised model and trains the same 2 steps ends bit-identical."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiderl.models.random_init import init_model
from tiderl.trainer.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tiderl.trainer.parallel import TrainBackend, make_backend
from tiderl.trainer.spawn import RankContext, run_ranks

BACKENDS = ("ddp", "fsdp2")
EXTRA = {"dataset_position": 42, "buffer": ["g1", "g2"]}


def build(name: str, seed: int) -> tuple[TrainBackend, torch.optim.Optimizer]:
    backend = make_backend(name, init_model("tiny", seed=seed))
    return backend, torch.optim.AdamW(backend.parameters(), lr=1e-2, weight_decay=0.1)


def train(backend: TrainBackend, optimizer: torch.optim.Optimizer, rank: int, steps: int) -> None:
    """Deterministic steps on a fixed batch per rank, so that the gradients are reduced."""
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(rank))
    mask = torch.ones_like(ids)
    for _ in range(steps):
        optimizer.zero_grad()
        (-backend.logprobs(ids, mask).sum()).backward()
        optimizer.step()


def snapshot(backend: TrainBackend) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in backend.full_state_dict().items()}


def randoms() -> tuple[torch.Tensor, float]:
    return torch.rand(4), random.random()


def _save_rank(ctx: RankContext, root: str) -> bytes:
    out = {}
    for name in BACKENDS:
        backend, optimizer = build(name, seed=0)
        train(backend, optimizer, ctx.rank, 1)
        save_checkpoint(Path(root) / name, backend, optimizer, version=1)
        train(backend, optimizer, ctx.rank, 1)
        save_checkpoint(Path(root) / name, backend, optimizer, version=2, extra=EXTRA)
        rng = randoms()
        train(backend, optimizer, ctx.rank, 2)
        out[name] = {"params": snapshot(backend), "rng": rng}
    return out


def _load_rank(ctx: RankContext, root: str) -> bytes:
    out = {}
    for name in BACKENDS:
        backend, optimizer = build(name, seed=1)
        folder = latest_checkpoint(Path(root) / name)
        meta = load_checkpoint(folder, backend, optimizer)
        rng = randoms()
        loaded = snapshot(backend)
        train(backend, optimizer, ctx.rank, 2)
        out[name] = {"params": snapshot(backend), "rng": rng, "folder": str(folder),
                     "loaded": loaded,
                     "meta": (meta.version, meta.extra, meta.world_size, meta.backend,
                              meta.rng_restored)}
    return out


@pytest.fixture(autouse=True)
def keep_rng() -> Iterator[None]:
    """Loading a checkpoint in this process sets its RNG; other tests keep theirs."""
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    yield
    torch.set_rng_state(torch_state)
    random.setstate(python_state)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict], Path]:
    root = tmp_path_factory.mktemp("ckpt")
    saved = run_ranks(_save_rank, 2, str(root), timeout_s=120)
    loaded = run_ranks(_load_rank, 2, str(root), timeout_s=120)
    return saved, loaded, root


@pytest.mark.parametrize("name", BACKENDS)
def test_resume_is_bit_exact(runs: tuple[list[dict], list[dict], Path], name: str) -> None:
    saved, loaded, root = runs
    for rank in (0, 1):
        params_a, params_b = saved[rank][name]["params"], loaded[rank][name]["params"]
        assert params_b.keys() == params_a.keys()
        assert all(torch.equal(params_b[k], params_a[k]) for k in params_a), f"rank {rank}"
        assert loaded[rank][name]["folder"] == str(root / name / "step-00000002")
        assert loaded[rank][name]["meta"] == (2, EXTRA, 2, name, True)


@pytest.mark.parametrize("name", BACKENDS)
def test_rng_is_restored_per_rank(runs: tuple[list[dict], list[dict], Path], name: str) -> None:
    saved, loaded, _ = runs
    for rank in (0, 1):
        (torch_a, py_a), (torch_b, py_b) = saved[rank][name]["rng"], loaded[rank][name]["rng"]
        assert torch.equal(torch_a, torch_b) and py_a == py_b
    assert not torch.equal(saved[0][name]["rng"][0], saved[1][name]["rng"][0])  # per-rank


@pytest.mark.parametrize("name", BACKENDS)
def test_two_rank_checkpoint_loads_in_one_process(runs: tuple[list[dict], list[dict], Path],
                                                  name: str) -> None:
    """DCP reshards (FSDP2's two shards into one plain model); per-rank RNG is then left alone."""
    _, loaded, root = runs
    backend, optimizer = build("ddp", seed=1)
    before = torch.get_rng_state()
    meta = load_checkpoint(root / name / "step-00000002", backend, optimizer)
    assert (meta.world_size, meta.rng_restored) == (2, False)
    assert torch.equal(torch.get_rng_state(), before)
    expected = loaded[0][name]["loaded"]
    assert all(torch.equal(t, expected[k]) for k, t in snapshot(backend).items())


def test_checkpoint_folder_layout(runs: tuple[list[dict], list[dict], Path]) -> None:
    folder = runs[2] / "ddp" / "step-00000002"
    names = {p.name for p in folder.iterdir()}
    assert {".metadata", "meta.json", "rng-rank0.pt", "rng-rank1.pt"} <= names
    meta = json.loads((folder / "meta.json").read_text())
    files = meta.pop("files")  # every file the ranks wrote, at its size
    assert meta == {"version": 2, "extra": EXTRA, "world_size": 2, "backend": "ddp"}
    assert files == {p.name: p.stat().st_size for p in folder.iterdir() if p.name != "meta.json"}
    assert {".metadata", "rng-rank0.pt", "rng-rank1.pt"} <= files.keys()


def test_single_process_round_trip(tmp_path: Path) -> None:
    backend, optimizer = build("ddp", seed=0)
    train(backend, optimizer, 0, 1)
    folder = save_checkpoint(tmp_path, backend, optimizer, version=5)
    train(backend, optimizer, 0, 1)
    expected = snapshot(backend)
    fresh, fresh_optimizer = build("ddp", seed=1)
    assert load_checkpoint(folder, fresh, fresh_optimizer).version == 5
    train(fresh, fresh_optimizer, 0, 1)
    assert all(torch.equal(t, expected[k]) for k, t in snapshot(fresh).items())


def test_missing_or_incomplete_checkpoint_raises(tmp_path: Path) -> None:
    backend, optimizer = build("ddp", seed=0)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nope'}.*does not exist"):
        load_checkpoint(tmp_path / "nope", backend, optimizer)
    folder = save_checkpoint(tmp_path, backend, optimizer, version=3)
    (folder / "meta.json").unlink()  # as if the save had crashed before its last write
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match=f"{folder}.*incomplete"):
        load_checkpoint(folder, backend, optimizer)
