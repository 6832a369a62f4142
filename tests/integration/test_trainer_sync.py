"""Weight sync over the weight feed: a source publishes the actor's state, receivers fetch it on
connections of their own (real sockets; the source in a real process where its death matters),
and a rank joining the actors gets the source's weights and AdamW state. FSDP2's full state dict
is gathered by two real rank processes (gloo)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import socket
import threading

import pytest
import torch

from tests.waiting import wait_until
from tiderl.engine.config import EngineConfig
from tiderl.engine.llm_engine import LLMEngine
from tiderl.models.qwen2 import Qwen2ForCausalLM
from tiderl.models.random_init import init_model
from tiderl.trainer.batch import pack
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.spawn import RankContext, run_ranks
from tiderl.trainer.sync import (
    layout_hash,
    load_weights,
    param_layout,
    plan_buckets,
    state_layout,
)
from tiderl.trainer.synthetic import synthetic_samples
from tiderl.trainer.weight_feed import (
    MAGIC,
    OPTIMIZER,
    REQUEST,
    WEIGHTS,
    FeedCancelled,
    FeedError,
    WeightFeed,
    fetch,
)
from tiderl.trainer.worker import ActorWorker, optimizer_layout

SMALL_BUCKET = 64 << 10
BUCKET_SIZES = (SMALL_BUCKET, 64 << 20, 0)
VERSION = 7
TOKEN = "t" * 64


def perturbed(model: Qwen2ForCausalLM, seed: int) -> Qwen2ForCausalLM:
    """Random biases and norms too, so that every tensor matters in a comparison."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def mixed_state() -> dict[str, torch.Tensor]:
    """bf16 and fp32 tensors interleaved by name, one of them larger than SMALL_BUCKET."""
    generator = torch.Generator().manual_seed(3)
    shapes = {"a.big": (200, 100), "b.bias": (17,), "c.w": (33, 5), "d.norm": (64,), "e.w": (3, 4)}
    return {name: torch.randn(shape, generator=generator).to(
        torch.bfloat16 if i % 2 == 0 else torch.float32)
        for i, (name, shape) in enumerate(shapes.items())}


def sent(model: Qwen2ForCausalLM) -> dict[str, torch.Tensor]:
    names = {name for name, _, _ in param_layout(model)}
    return {k: v for k, v in model.state_dict().items() if k in names}


@pytest.fixture()
def feed():
    feed = WeightFeed(TOKEN, host="127.0.0.1", wait_s=30.0)
    yield feed
    feed.close()


def address(feed: WeightFeed) -> str:
    return f"127.0.0.1:{feed.port}"


@pytest.mark.parametrize("bucket_bytes", BUCKET_SIZES)
def test_a_receiver_gets_the_sources_tensors(bucket_bytes: int) -> None:
    model = perturbed(init_model("tiny", seed=0), seed=0)
    layout = param_layout(model)
    feed = WeightFeed(TOKEN, host="127.0.0.1", bucket_bytes=bucket_bytes)
    try:
        published = feed.publish(VERSION, {WEIGHTS: (layout, model.state_dict())})
        got = fetch(address(feed), VERSION, layout, token=TOKEN, bucket_bytes=bucket_bytes)
    finally:
        feed.close()
    expected = sent(model)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert published == sum(t.numel() * t.element_size() for t in expected.values())


def test_what_is_published_is_a_copy(feed: WeightFeed) -> None:
    """The source trains on at once: a change to its tensors after publishing is not served."""
    state = mixed_state()
    layout = state_layout(state)
    before = {k: v.clone() for k, v in state.items()}
    feed.publish(1, {WEIGHTS: (layout, state)})
    for tensor in state.values():
        tensor.add_(1)
    got = fetch(address(feed), 1, layout, token=TOKEN)
    assert all(got[k].dtype == before[k].dtype and torch.equal(got[k], before[k])
               for k in before)


def test_an_engine_loaded_from_the_feed_gives_the_sources_logits(feed: WeightFeed) -> None:
    source = perturbed(init_model("tiny", seed=0), seed=0)
    layout = param_layout(source)
    feed.publish(VERSION, {WEIGHTS: (layout, source.state_dict())})
    receiver = init_model("tiny", seed=1)
    engine = LLMEngine(receiver, EngineConfig(kv_cache_tokens=256), eos_token_id=None)
    engine.update_weights(fetch(address(feed), VERSION, layout, token=TOKEN), VERSION)
    ids = torch.randint(0, source.config.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(receiver(ids), source(ids))
    assert engine.version == VERSION


def test_a_request_for_a_version_to_come_waits_for_it(feed: WeightFeed) -> None:
    state = mixed_state()
    layout = state_layout(state)
    feed.publish(1, {WEIGHTS: (layout, state)})
    got: dict = {}
    worker = threading.Thread(target=lambda: got.update(
        fetch(address(feed), 2, layout, token=TOKEN)))
    worker.start()
    wait_until(lambda: feed.waiting, "the request for version 2 waiting")
    newer = {k: v + 1 for k, v in state.items()}
    feed.publish(2, {WEIGHTS: (layout, newer)})
    worker.join()
    assert all(torch.equal(got[k], newer[k]) for k in state)


@pytest.mark.parametrize(("version", "layout_of", "token", "match"), [
    (1, lambda layout: layout, "wrong", "not a weight-feed request of this job"),
    (0, lambda layout: layout, TOKEN, "version 0 is not served: the source serves 1"),
    (1, lambda layout: layout[1:], TOKEN, "layout differs"),
])
def test_a_bad_request_gets_a_worded_refusal_and_the_feed_serves_on(
        feed: WeightFeed, version: int, layout_of, token: str, match: str) -> None:
    state = mixed_state()
    layout = state_layout(state)
    feed.publish(1, {WEIGHTS: (layout, state)})
    with pytest.raises(FeedError, match=match):
        fetch(address(feed), version, layout_of(layout), token=token)
    with pytest.raises(FeedError, match="without its optimizer state"):
        fetch(address(feed), 1, layout, OPTIMIZER, token=TOKEN)
    assert fetch(address(feed), 1, layout, token=TOKEN).keys() == state.keys()


def test_a_source_state_that_does_not_fit_its_layout_publishes_nothing(feed: WeightFeed) -> None:
    state = mixed_state()
    layout = state_layout(state)
    feed.publish(1, {WEIGHTS: (layout, state)})
    lacking = {k: v for k, v in state.items() if k != "c.w"}
    with pytest.raises(ValueError, match=r"the source state has nothing for c\.w"):
        feed.publish(2, {WEIGHTS: (layout, lacking)})
    assert fetch(address(feed), 1, layout, token=TOKEN).keys() == state.keys()


def test_a_stalled_receiver_holds_no_other_back(feed: WeightFeed) -> None:
    """A receiver that asks, then reads nothing (stopped, or its host gone), keeps its own
    connection only: the source and the other receivers go on."""
    state = {"w": torch.randn(4096, 1024)}  # 16 MiB: more than the socket buffers hold
    layout = state_layout(state)
    feed.publish(1, {WEIGHTS: (layout, state)})
    with socket.create_connection(("127.0.0.1", feed.port)) as stalled:
        stalled.sendall(REQUEST.pack(MAGIC, 1, layout_hash(layout), WEIGHTS, len(TOKEN))
                        + TOKEN.encode())
        stalled.recv(1)  # the answer's first byte: the source is sending to it now
        got = fetch(address(feed), 1, layout, token=TOKEN)
        assert torch.equal(got["w"], state["w"])


def test_a_fetch_is_left_when_the_rank_is_told_to(feed: WeightFeed) -> None:
    """A newer boundary came (its source died): the fetch ends at once, not after stall_s."""
    layout = state_layout(mixed_state())
    told = threading.Event()
    errors: list[Exception] = []

    def run() -> None:
        try:
            fetch(address(feed), 5, layout, token=TOKEN, cancel=told.is_set, stall_s=600.0)
        except FeedError as exc:
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    wait_until(lambda: feed.waiting, "the request for version 5 waiting")
    told.set()
    worker.join()
    assert len(errors) == 1 and isinstance(errors[0], FeedCancelled)


def _serve_until_killed(out, layout_state) -> None:
    """A source in a process of its own: its port, then "waiting" once a request waits."""
    feed = WeightFeed(TOKEN, host="127.0.0.1", wait_s=600.0)
    feed.publish(1, {WEIGHTS: layout_state})
    out.put(feed.port)
    wait_until(lambda: feed.waiting, "a request waiting", timeout_s=600.0)
    out.put("waiting")
    threading.Event().wait()


def test_a_source_that_dies_ends_its_receivers_fetch_at_once() -> None:
    """The receiver waits for version 2, which the source never publishes: it dies. The fetch
    breaks off when the connection closes (stall_s is far away)."""
    state = mixed_state()
    layout = state_layout(state)
    context = multiprocessing.get_context("spawn")
    said = context.Queue()
    source = context.Process(target=_serve_until_killed, args=(said, (layout, state)),
                             daemon=True)
    source.start()
    try:
        port = said.get(timeout=120)
        assert fetch(f"127.0.0.1:{port}", 1, layout, token=TOKEN).keys() == state.keys()
        errors: list[Exception] = []

        def run() -> None:
            try:
                fetch(f"127.0.0.1:{port}", 2, layout, token=TOKEN, stall_s=600.0)
            except FeedError as exc:
                errors.append(exc)

        worker = threading.Thread(target=run)
        worker.start()
        assert said.get(timeout=120) == "waiting"
        source.kill()
        worker.join()
        source.join()  # gone: its listening socket too
        assert len(errors) == 1 and "closed the connection" in str(errors[0])
        with pytest.raises(FeedError, match="cannot fetch"):
            fetch(f"127.0.0.1:{port}", 2, layout, token=TOKEN)
    finally:
        source.kill()
        source.join()


JOIN_CONFIG = TrainerConfig(lr=1e-2, kl_beta=0.0)


def _actor_step(actor: ActorWorker, seed: int) -> None:
    batch = pack(synthetic_samples(4, vocab_size=1568, min_tokens=8, max_tokens=24, seed=seed))
    actor.train(batch, None, sync=True)
    actor.optimizer_step(batch.num_loss_tokens)


def test_a_joining_rank_gets_the_sources_weights_and_optimizer_state(feed: WeightFeed) -> None:
    """The source actor after one step publishes its weights and AdamW state; a rank with only
    its own initial model (as a rank taking the actor role has) builds its actor from them.
    Both then take the same step and stay equal."""
    source_model = init_model("tiny", seed=0)
    source = ActorWorker(make_backend("ddp", source_model), JOIN_CONFIG)
    _actor_step(source, seed=1)
    layout, moments = param_layout(source_model), optimizer_layout(source_model)
    feed.publish(1, {WEIGHTS: (layout, source.backend.full_state_dict()),
                     OPTIMIZER: (moments, source.optimizer_state())})
    model = init_model("tiny", seed=1)
    load_weights(model, fetch(address(feed), 1, layout, token=TOKEN))
    joiner = ActorWorker(make_backend("ddp", model), JOIN_CONFIG)
    joiner.load_optimizer_state(fetch(address(feed), 1, moments, OPTIMIZER, token=TOKEN))
    for actor in (source, joiner):
        _actor_step(actor, seed=2)
    a, b = source.backend.full_state_dict(), joiner.backend.full_state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fsdp2_full(ctx: RankContext, arg: None) -> dict[str, torch.Tensor]:
    return make_backend("fsdp2", init_model("tiny", seed=2)).full_state_dict()


def test_fsdp2_full_state_dict_is_the_unsharded_model() -> None:
    expected = init_model("tiny", seed=2).state_dict()
    for full in run_ranks(_fsdp2_full, 2, timeout_s=120):
        assert full.keys() == expected.keys()
        assert all(torch.equal(full[name], expected[name]) for name in expected)


def test_plan_buckets_cuts_by_size_and_dtype() -> None:
    layout = param_layout(init_model("tiny"))
    per_tensor = plan_buckets(layout, 0)
    small = plan_buckets(layout, SMALL_BUCKET)
    assert len(per_tensor) == len(layout)
    assert len(plan_buckets(layout, 64 << 20)) == 1
    assert len(layout) > len(small) > 1
    embed = next(b for b in small if b.entries[0][0] == "model.embed_tokens.weight")
    assert len(embed.entries) == 1 and embed.numel * 4 > SMALL_BUCKET  # larger: alone
    assert all(b.numel * 4 <= SMALL_BUCKET for b in small if len(b.entries) > 1)
    big, vec = ((160, 128), torch.float32), ((16,), torch.float32)
    alternating = [(f"{i}.{kind}", *spec) for i in range(2) for kind, spec in (("w", big),
                                                                              ("v", vec))]
    assert [[e[0] for e in b.entries] for b in plan_buckets(alternating, SMALL_BUCKET)] == [
        ["0.w"], ["1.w"], ["0.v", "1.v"]]  # small tensors between big ones travel together
    mixed = plan_buckets(state_layout(mixed_state()), 64 << 20)
    assert [b.dtype for b in mixed] == [torch.bfloat16, torch.float32]
    assert [[e[0] for e in b.entries] for b in mixed] == [["a.big", "c.w", "e.w"],
                                                         ["b.bias", "d.norm"]]


def test_param_layout_skips_tied_lm_head() -> None:
    model = init_model("tiny")
    assert "lm_head.weight" in [name for name, _, _ in param_layout(model)]
    model = Qwen2ForCausalLM(dataclasses.replace(model.config, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [name for name, _, _ in param_layout(model)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert names == sorted(names)


