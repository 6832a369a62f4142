"""The embedded engine end to end on a tiny fp32 model: scheduler + model runner + sampler."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.native import native_or_skip
from tiderl.engine.config import EngineConfig
from tiderl.engine.kernels import TorchKernels
from tiderl.engine.llm_engine import EngineAsleepError, EngineBusyError, LLMEngine
from tiderl.engine.model_runner import padding_pays
from tiderl.engine.request import SamplingParams
from tiderl.engine.sampler import Sampler
from tiderl.models.attention import PagedBatch
from tiderl.models.qwen2 import token_logprobs
from tiderl.models.random_init import init_model

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return init_model("tiny", seed=0)


def engine(model, kv_tokens=512, budget=64, max_num_seqs=16):
    config = EngineConfig(kv_cache_tokens=kv_tokens, block_size=BS, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget)
    return LLMEngine(model, config, eos_token_id=None)


def run(eng, turns):
    """Queue ``(task_id, prompt, sampling)`` turns and step until all finish; requests back."""
    requests = [eng.add_request(*turn) for turn in turns]
    for _ in range(1000):
        if all(r.is_finished for r in requests):
            return requests
        eng.step()
    raise AssertionError("did not finish")


def dense_greedy(model, prompt, num_tokens):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num_tokens):
            ids = torch.cat((ids, model(ids)[:, -1:].argmax(-1)), dim=1)
    return ids[0, len(prompt):].tolist()


def prompts(n, length=11, start=7):
    return [list(range(start + 50 * i, start + 50 * i + length + i)) for i in range(n)]


def test_greedy_batched_with_chunked_prefill_equals_dense_greedy(model):
    eng = engine(model, budget=16)  # 16-token budget: prompts are prefilled in chunks
    requests = run(eng, [(f"t{i}", p, GREEDY) for i, p in enumerate(prompts(5))])
    for request, prompt in zip(requests, prompts(5), strict=True):
        assert request.output_token_ids == dense_greedy(model, prompt, GREEDY.max_tokens)
        assert request.finish_reason.value == "length"


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(max_tokens=6, seed=5)])
def test_logprobs_equal_the_trainer_logprobs(model, sampling):
    """Greedy reports the model's logprobs; temperature 1, top-p 1 samples the model itself."""
    eng = engine(model)
    requests = run(eng, [(f"t{i}", p, sampling) for i, p in enumerate(prompts(3))])
    for request in requests:
        ids = torch.tensor([request.prompt_token_ids + request.output_token_ids])
        with torch.no_grad():
            expected = token_logprobs(model, ids)[0, request.num_prompt_tokens:]
        assert torch.allclose(torch.tensor(request.output_logprobs), expected, atol=1e-5)


def test_second_turn_computes_exactly_the_new_tokens(model):
    eng = engine(model)
    (t1,) = run(eng, [("task", list(range(10, 23)), GREEDY)])  # 13 + 6 tokens, 18 computed
    before = eng.metrics()
    assert before.prompt_tokens_computed == 13 and before.decode_tokens == 6
    prompt2 = [*t1.prompt_token_ids, *t1.output_token_ids, 40, 41, 42]  # 22 tokens
    (t2,) = run(eng, [("task", prompt2, GREEDY)])
    after = eng.metrics()
    assert t2.num_cached_tokens == 16  # 4 full blocks of turn 1's 18 computed tokens
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == 22 - 16
    assert (after.prefix_cache_queries - before.prefix_cache_queries,
            after.prefix_cache_hits - before.prefix_cache_hits) == (22, 16)
    assert t2.output_token_ids == dense_greedy(model, prompt2, 6)


def test_pinned_task_keeps_its_blocks_through_a_flood(model):
    eng = engine(model, kv_tokens=64, budget=64)  # 16 blocks
    pinned, unpinned = run(eng, [("a", list(range(10, 20)), SamplingParams(3, 0.0)),
                                 ("b", list(range(60, 70)), SamplingParams(3, 0.0))])
    assert eng.pin("a") == 12  # 12 computed tokens, 3 full blocks
    assert eng.token_usage().num_pinned_tokens == 12
    flood = [(f"f{i}", list(range(100 + 30 * i, 120 + 30 * i)), SamplingParams(2, 0.0))
             for i in range(6)]
    for turn in flood:
        run(eng, [turn])
    turns = [(r.task_id, [*r.prompt_token_ids, *r.output_token_ids, 5], SamplingParams(2, 0.0))
             for r in (pinned, unpinned)]
    a2, b2 = run(eng, turns)
    assert (a2.num_cached_tokens, b2.num_cached_tokens) == (12, 0)
    eng.unpin("a")
    assert eng.token_usage().num_pinned_tokens == 0


def test_flush_drops_unreferenced_blocks_but_keeps_pinned_ones(model):
    eng = engine(model)
    a, b = run(eng, [("a", list(range(10, 20)), SamplingParams(3, 0.0)),
                     ("b", list(range(60, 70)), SamplingParams(3, 0.0))])
    eng.pin("a")
    eng.flush()
    assert eng.token_usage().num_cached_tokens == 0
    a2, b2 = run(eng, [(r.task_id, [*r.prompt_token_ids, *r.output_token_ids, 5], GREEDY)
                       for r in (a, b)])
    assert (a2.num_cached_tokens, b2.num_cached_tokens) == (12, 0)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(model):
    sampling = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=11)
    prompt = list(range(30, 42))
    (alone,) = run(engine(model), [("x", prompt, sampling)])
    batch = run(engine(model), [("y", p, SamplingParams(8, 1.0)) for p in prompts(3)]
                + [("x", prompt, sampling)])
    other = run(engine(model), [("x", prompt, SamplingParams(8, 0.9, 0.9, seed=12))])
    assert alone.output_token_ids == batch[-1].output_token_ids
    assert alone.output_logprobs == pytest.approx(batch[-1].output_logprobs, abs=1e-5)
    assert alone.output_token_ids != other[0].output_token_ids


def test_sampler_top_p_keeps_the_nucleus_and_renormalises():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    seen = set()
    for n in range(200):
        token, logprob = sampler(logits, [SamplingParams(temperature=1.0, top_p=0.7, seed=1)],
                                 [n])
        seen.add(int(token))
        expected = {0: 0.5 / 0.8, 1: 0.3 / 0.8}[int(token)]
        assert float(logprob) == pytest.approx(torch.log(torch.tensor(expected)).item())
    assert seen == {0, 1}
    token, logprob = sampler(logits, [SamplingParams(temperature=1.0, top_p=0.1)], [0])
    assert int(token) == 0 and float(logprob) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize(("prompt", "sampling", "message"), [
    ([], GREEDY, "empty prompt"),
    ([1, 2, 10**6], GREEDY, "outside the vocabulary"),
    ([1, -3], GREEDY, "outside the vocabulary"),
    ([1] * 5000, GREEDY, "longer than max_model_len"),
    ([1] * 600, GREEDY, "more than the KV pool"),
    ([1, 2], {"max_tokens": 3}, "expected SamplingParams"),
    ([1, 2], SamplingParams(stop_token_ids=(10**6,)), "stop_token_ids"),
])
def test_bad_inputs_raise_clear_value_errors(model, prompt, sampling, message):
    with pytest.raises(ValueError, match=message):
        engine(model).add_request("t", prompt, sampling)


def test_bad_sampling_params_raise():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_async_generate_and_update_weights(model):
    local = init_model("tiny", seed=0)
    eng = engine(local)

    async def scenario():
        prompt = list(range(10, 30))
        outs = await asyncio.gather(*(eng.generate(f"t{i}", p, GREEDY)
                                      for i, p in enumerate([prompt, *prompts(3)])))
        eng.update_weights(init_model("tiny", seed=1).state_dict(), version=3)
        after = await eng.generate("t0", prompt, GREEDY)
        await eng.close()
        return outs[0], after

    before, after = asyncio.run(scenario())
    assert before.output_ids == dense_greedy(model, list(range(10, 30)), 6)
    assert (before.version, after.version, eng.version) == (0, 3, 3)
    assert after.num_cached_tokens == 0  # the prefix cache was reset
    assert after.output_ids == dense_greedy(init_model("tiny", seed=1), list(range(10, 30)), 6)
    assert after.output_ids != before.output_ids
    with pytest.raises(ValueError, match="unknown parameters"):
        eng.update_weights({"nope": torch.zeros(1)}, version=4)


def test_generate_works_across_event_loops_without_close(model):
    eng = engine(model)
    first = asyncio.run(eng.generate("a", list(range(10, 20)), GREEDY))
    second = asyncio.run(eng.generate("a", list(range(10, 20)), GREEDY))
    assert first.output_ids == second.output_ids and second.num_cached_tokens == 8


def test_sleep_frees_weights_and_kv_and_wake_up_serves_the_weights_it_is_given(model):
    local = init_model("tiny", seed=0)
    eng = engine(local)
    (turn,) = run(eng, [("a", list(range(10, 20)), GREEDY)])
    assert eng.pin("a") == 12
    eng.sleep()
    assert eng.is_asleep and eng.runner.kv_cache is None and not eng.runner.linears.packed
    assert all(p.numel() == 0 for p in local.parameters())
    usage = eng.token_usage()
    assert (usage.num_pinned_tokens, usage.num_cached_tokens, usage.num_used_tokens) == (0, 0, 0)
    with pytest.raises(EngineAsleepError, match="asleep"):
        eng.add_request("a", list(range(10, 20)), GREEDY)
    with pytest.raises(EngineAsleepError, match="wake_up takes the weights"):
        eng.update_weights(model.state_dict(), 1)
    other = init_model("tiny", seed=1).state_dict()
    partial = {k: v for k, v in other.items() if "layers.0." not in k}
    with pytest.raises(ValueError, match=r"wake_up: the weights lack \['model.layers.0"):
        eng.wake_up(partial, 5)
    assert eng.is_asleep
    eng.wake_up(other, 5)
    prompt = [*turn.prompt_token_ids, *turn.output_token_ids, 5]
    (again,) = run(eng, [("a", prompt, GREEDY)])
    assert not eng.is_asleep and eng.version == 5
    assert again.num_cached_tokens == 0  # nothing of the old weights' KV survived the sleep
    assert again.output_token_ids == dense_greedy(init_model("tiny", seed=1), prompt, 6)


def test_sleep_is_refused_while_requests_are_in_flight(model):
    eng = engine(model)
    eng.add_request("a", list(range(10, 20)), GREEDY)
    with pytest.raises(EngineBusyError, match="1 requests in flight"):
        eng.sleep()
    assert not eng.is_asleep


@pytest.mark.parametrize(("kv_on_update", "cached"), [("flush", 0), ("keep", 12)])
def test_kv_on_update_decides_whether_a_pinned_prefix_survives_an_update(
        model, kv_on_update, cached):
    config = EngineConfig(kv_cache_tokens=512, block_size=BS, max_num_batched_tokens=64,
                          kv_on_update=kv_on_update)
    eng = LLMEngine(init_model("tiny", seed=0), config, eos_token_id=None)
    (turn,) = run(eng, [("a", list(range(10, 20)), SamplingParams(3, 0.0))])
    eng.pin("a")
    eng.update_weights(init_model("tiny", seed=1).state_dict(), version=1)
    (again,) = run(eng, [("a", [*turn.prompt_token_ids, *turn.output_token_ids, 5], GREEDY)])
    assert again.num_cached_tokens == cached


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_runner_forward_equals_the_model_paged_forward(model, dtype, tol, kernels):
    """The runner's own forward (packed projections, the non-GEMM parts through the C++ kernels
    or their torch twins) against the model's forward_paged, step by step on separate caches:
    prefill chunks of unequal lengths (one attention problem each), mixed steps (a decoding
    sequence among prefill chunks that share one problem, a chunk among decoding sequences),
    then decode steps of sequences of different lengths over scattered blocks."""
    local = init_model("tiny", seed=0).to(dtype)
    config = EngineConfig(kv_cache_tokens=128, block_size=BS, kernels=kernels)
    with native_or_skip():
        runner = LLMEngine(local, config, None).runner
    assert isinstance(runner.kernels, TorchKernels) == (kernels == "torch")
    reference = local.new_kv_cache(32, BS)
    tables = [[5, 17, 2, 30, 9, 11, 25], [8, 1, 19, 4, 27], [14, 3, 22, 7]]
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 1500, (n,), generator=gen).tolist() for n in (26, 19, 15)]
    done = [0, 0, 0]
    for step in ([12, 2, 3], [7, 1, 6], [1, 3, 1], [1, 1, 1], [1, 1, 1]):
        positions, batch = PagedBatch.build(tables, done, step, BS)
        ids = torch.tensor([t for s, n in enumerate(step) for t in seqs[s][done[s]:done[s] + n]])
        rows = batch.last_token_indices()
        decode = all(n == 1 for n in step)
        with torch.inference_mode():
            ours = runner._forward(ids, positions, batch, None if decode else rows)
            theirs = local.forward_paged(ids, positions, reference, batch, rows)
        assert ours.dtype == theirs.dtype == dtype
        torch.testing.assert_close(ours.float(), theirs.float(), atol=tol, rtol=tol)
        done = [d + n for d, n in zip(done, step, strict=True)]


def test_prefill_chunks_share_one_padded_problem_unless_it_more_than_doubles_their_work():
    assert padding_pays([33] * 32, [33] * 32)  # equal prompts: no padding at all
    assert not padding_pays([300, *[30] * 7], [300, *[280] * 7])  # 4.8x the work
    assert padding_pays([7, 6], [19, 9]) and not padding_pays([12, 2, 3], [12, 2, 3])


def test_a_decode_step_in_one_call_equals_the_layer_loop(model):
    """With the C++ kernels a decode step runs every layer in one ``decode_layers`` call; the
    same step through the Python layer loop (same kernels, same projections) gives the same
    logits, and the one-call path is the one a decode step takes."""
    with native_or_skip():
        runner = LLMEngine(model, EngineConfig(kv_cache_tokens=128, block_size=BS,
                                               kernels="native"), None).runner
    tables, lens = [[3, 9, 4], [7, 1], [12, 5, 2, 8]], [9, 5, 13]
    prompts = [list(range(20 + 40 * s, 20 + 40 * s + n)) for s, n in enumerate(lens)]
    with torch.inference_mode():
        positions, batch = PagedBatch.build(tables, [0, 0, 0], lens, BS)
        runner._forward(torch.tensor([t for p in prompts for t in p]), positions, batch,
                        batch.last_token_indices())
        positions, batch = PagedBatch.build(tables, lens, [1, 1, 1], BS)
        ids = torch.tensor([5, 6, 7])
        calls, original = [], runner._decode_layers

        def counted(*args):
            calls.append(args)
            return original(*args)

        runner._decode_layers = counted
        one_call = runner._forward(ids, positions, batch, None)
        assert len(calls) == 1
        runner._one_call = False
        loop = runner._forward(ids, positions, batch, None)
    assert len(calls) == 1
    torch.testing.assert_close(one_call, loop, atol=1e-5, rtol=1e-5)
