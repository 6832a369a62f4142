"""The embedded engine's bounds: the model's context length, pins that would starve a request,
and per-task state that ends with its task (exact counts, not memory)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest

from tiderl.engine.config import EngineConfig
from tiderl.engine.kv_cache_manager import PinRefused
from tiderl.engine.llm_engine import LLMEngine
from tiderl.engine.request import SamplingParams
from tiderl.models.qwen2 import Qwen2ForCausalLM
from tiderl.models.random_init import init_model

BS = 4
CONTEXT = 64  # max_position_embeddings of the model below


@pytest.fixture(scope="module")
def model():
    """The tiny model's weights with a 64-token context, so that prompts can reach it."""
    tiny = init_model("tiny", seed=0)
    short = Qwen2ForCausalLM(replace(tiny.config, max_position_embeddings=CONTEXT))
    short.load_state_dict(tiny.state_dict())
    return short.eval()


def engine(model, kv_tokens=256):
    config = EngineConfig(kv_cache_tokens=kv_tokens, block_size=BS, max_num_batched_tokens=64)
    return LLMEngine(model, config, eos_token_id=None)


def run(eng, turns):
    requests = [eng.add_request(*turn) for turn in turns]
    for _ in range(2000):
        if all(r.is_finished for r in requests):
            return requests
        eng.step()
    raise AssertionError("did not finish")


def test_max_tokens_is_cut_to_the_context_left_and_a_full_prompt_is_refused(model):
    eng = engine(model)
    (near,) = run(eng, [("a", list(range(10, 10 + CONTEXT - 5)), SamplingParams(100, 0.0))])
    assert near.num_output_tokens == 5 and near.finish_reason.value == "length"
    assert near.num_tokens == CONTEXT  # prompt + outputs: never past max_position_embeddings
    (short,) = run(eng, [("b", [5, 6], SamplingParams(3, 0.0))])
    assert short.num_output_tokens == 3  # under the cap: as asked
    (last,) = run(eng, [("c", list(range(CONTEXT - 1)), SamplingParams(8, 0.0))])
    assert last.num_output_tokens == 1
    with pytest.raises(ValueError, match=f"{CONTEXT} tokens fill max_model_len"):
        eng.add_request("d", list(range(CONTEXT)), SamplingParams(1, 0.0))
    with pytest.raises(ValueError, match="longer than max_model_len"):
        eng.add_request("d", list(range(CONTEXT + 1)), SamplingParams(1, 0.0))


def test_a_pin_is_refused_while_it_would_starve_the_largest_request_in_the_engine(model):
    eng = engine(model, kv_tokens=64)  # 16 blocks
    run(eng, [("a", list(range(10, 30)), SamplingParams(3, 0.0))])  # 22 tokens of KV: 5 blocks
    waiting = eng.add_request("big", list(range(100, 140)), SamplingParams(8, 0.0))  # 47: 12
    with pytest.raises(PinRefused, match=r"leave 44 of 64 KV tokens out of pins, fewer than a "
                                         r"request needs \(48\)"):
        eng.pin("a")
    assert eng.token_usage().num_pinned_tokens == 0
    run(eng, [])
    while not waiting.is_finished:
        eng.step()
    # idle again, the pin is taken: 4 of a's 5 blocks, the big request took its tail block
    assert eng.pin("a") == 16


def test_pins_never_wedge_the_engine_a_request_that_cannot_fit_releases_them(model):
    """The fault measured on the server: 4 pinned contexts held the pool and every later
    request waited forever. The head of the queue now releases pins, oldest first."""
    eng = engine(model, kv_tokens=64)
    firsts = run(eng, [(f"p{i}", list(range(10 + 20 * i, 22 + 20 * i)), SamplingParams(3, 0.0))
                       for i in range(4)])
    assert [eng.pin(f"p{i}") for i in range(4)] == [12] * 4
    assert eng.token_usage().num_pinned_tokens == 48
    (big,) = run(eng, [("big", list(range(300, 350)), SamplingParams(5, 0.0))])  # 14 blocks
    assert big.num_output_tokens == 5
    assert eng.metrics().num_pins_released == 4  # 16 - 3 blocks is 13 < 14: all four went
    small = [(r.task_id, [*r.prompt_token_ids, *r.output_token_ids, 1], SamplingParams(2, 0.0))
             for r in firsts[:2]]
    assert [r.num_output_tokens for r in run(eng, small)] == [2, 2]


def test_per_task_state_ends_with_the_task_and_with_a_flush(model):
    eng = engine(model)
    kv = eng.scheduler.kv_cache
    assert kv.task_ids == set()

    async def play(task_id, turns):
        prompt = list(range(7, 17))
        for _ in range(turns):
            out = await eng.generate(task_id, prompt, SamplingParams(3, 0.0))
            eng.pin(task_id)
            prompt = prompt + out.output_ids + [5]
        eng.forget(task_id)  # what the agent loop does when a task ends

    async def scenario():
        await asyncio.gather(*(play(f"t{i}", 3) for i in range(20)))
        after_tasks = len(kv.task_ids), eng.metrics().num_tasks
        for i in range(5):  # turns of tasks that never say they ended
            await eng.generate(f"loose{i}", [1, 2, 3, 4, 5, 6], SamplingParams(2, 0.0))
        await eng.generate("kept", [9, 8, 7, 6, 5], SamplingParams(2, 0.0))
        eng.pin("kept")
        loose = set(kv.task_ids)
        eng.flush()
        return after_tasks, loose, set(kv.task_ids)

    after_tasks, loose, after_flush = asyncio.run(scenario())
    assert after_tasks == (0, 0)  # 20 tasks of 3 turns each, pinned every turn: none left
    assert loose == {f"loose{i}" for i in range(5)} | {"kept"}
    assert after_flush == {"kept"}  # a flush frees every unpinned task's state
    eng.forget("kept")
    assert kv.task_ids == set() and eng.token_usage().num_pinned_tokens == 0


def test_generate_waits_for_a_step_off_the_event_loop_and_a_cancelled_turn_leaves_nothing(model):
    """A step holds the engine lock for its whole forward: ``generate`` waits for it in a
    thread, so the event loop keeps serving; cancelled while it waits, the turn is withdrawn
    (whichever of the cancel and the queueing thread comes first)."""
    eng = engine(model)
    held, ticked, seen = threading.Event(), threading.Event(), {}

    def step() -> None:  # holds the lock until the event loop has run on (or 30 s passed)
        with eng._lock:
            held.set()
            seen["loop_ran"] = ticked.wait(30)

    async def scenario():
        turn = asyncio.create_task(eng.generate("t", [7, 8, 9], SamplingParams(3, 0.0)))
        for _ in range(20):
            await asyncio.sleep(0.005)
        ticked.set()
        waiting = not turn.done()
        turn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await turn
        return waiting, await eng.generate("u", [7, 8, 9], SamplingParams(3, 0.0))

    stepping = threading.Thread(target=step)
    stepping.start()
    held.wait()
    # asyncio.run returns once its default executor's threads are done: the cancelled turn's
    # queueing thread too, which may still have been on its way to the lock
    waiting, after = asyncio.run(scenario())
    stepping.join()
    assert seen["loop_ran"] and waiting
    assert eng._withdrawn == set() and not eng.scheduler.has_unfinished
    assert not eng.scheduler.requests  # the cancelled turn is not left queued
    assert len(after.output_ids) == 3  # and the engine still serves
