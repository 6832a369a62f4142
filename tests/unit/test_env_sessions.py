"""The session table and the in-process service, driven by a fake clock.

``FakeClock`` is a plain object standing in for ``time.monotonic`` (the only external edge).
"""

import asyncio

import pytest

from tiderl.core.config import ConfigError
from tiderl.env.client import EnvClientError, InProcessEnvClient
from tiderl.env.config import EnvConfig
from tiderl.env.protocol import MAX_ACTION_CHARS, ObservationRequest, ProtocolError, decode
from tiderl.env.sessions import SessionLimit, SessionState, SessionTable, UnknownSession

TTL = 10.0


class FakeClock:
    """Stand-in for the monotonic clock: time moves only when a test says so."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def table(max_sessions: int = 4) -> SessionTable[str]:
    return SessionTable(max_sessions=max_sessions, idle_ttl_s=TTL)


def test_lifecycle_create_touch_pause_resume_end():
    t = table()
    s = t.create("guess", "env-a", now=0.0)
    assert (s.id, s.env_name, s.env, s.state) == ("s1", "guess", "env-a", SessionState.ACTIVE)
    assert t.touch("s1", now=5.0).last_active == 5.0
    assert t.pause("s1", now=6.0).state is SessionState.PAUSED
    assert (t.num_open, t.num_paused) == (1, 1)
    assert t.resume("s1", now=7.0).state is SessionState.ACTIVE
    assert t.end("s1", now=8.0) is s
    assert t.num_open == 0 and t.counters.num_ended == 1
    with pytest.raises(UnknownSession, match="unknown"):
        t.get("s1", now=8.0)
    with pytest.raises(UnknownSession):
        t.end("nope", now=8.0)


def test_idle_session_expires_after_the_ttl_and_touch_extends_it():
    t = table()
    t.create("guess", "a", now=0.0)
    t.create("guess", "b", now=0.0)
    t.touch("s2", now=9.0)
    assert t.get("s1", now=TTL).id == "s1"  # exactly at the TTL: still alive
    assert t.expire(now=TTL + 0.5) == ["s1"]
    assert t.counters.num_expired == 1
    with pytest.raises(UnknownSession, match="expired"):
        t.get("s2", now=9.0 + TTL + 0.1)  # get drops an expired session itself
    assert t.num_open == 0 and t.counters.num_expired == 2


def test_paused_session_outlives_the_ttl_and_a_resumed_one_expires_again():
    t = table()
    t.create("guess", "a", now=0.0)
    t.pause("s1", now=1.0)
    assert t.expire(now=1000.0) == []
    assert t.get("s1", now=1000.0).state is SessionState.PAUSED
    t.resume("s1", now=1000.0)  # the idle clock restarts from the resume
    assert t.expire(now=1000.0 + TTL) == []
    assert t.expire(now=1000.0 + TTL + 0.1) == ["s1"]


def test_a_full_table_evicts_the_longest_idle_session_active_before_paused():
    t = table(max_sessions=3)
    t.create("guess", "a", now=0.0)
    t.create("guess", "b", now=1.0)
    t.create("guess", "c", now=2.0)
    t.touch("s1", now=3.0)  # s2 is now the longest idle
    assert t.create("guess", "d", now=4.0).id == "s4"
    assert sorted(t.sessions) == ["s1", "s3", "s4"] and t.counters.num_evicted == 1
    with pytest.raises(UnknownSession):
        t.get("s2", now=4.0)
    t.pause("s3", now=5.0)  # paused: evicted only when no active session is left to evict
    t.create("guess", "e", now=6.0)
    assert sorted(t.sessions) == ["s3", "s4", "s5"]  # s1 (idle since 3.0) went, not s3
    t.pause("s4", now=7.0)
    t.pause("s5", now=7.5)
    t.create("guess", "f", now=8.0)
    assert sorted(t.sessions) == ["s4", "s5", "s6"]  # all paused: the longest paused went
    assert (t.counters.num_evicted, t.counters.num_rejected) == (3, 0)


def test_a_full_table_expires_idle_sessions_before_evicting_and_one_with_room_leaves_them():
    t = table(max_sessions=3)
    t.create("guess", "a", now=0.0)
    t.create("guess", "b", now=5.0)
    t.create("guess", "c", now=TTL + 1)  # room: s1, expired, waits for a get or a sweep
    assert t.num_open == 3 and t.counters.num_expired == 0
    t.create("guess", "d", now=TTL + 2)  # full: s1 expires, nothing is evicted
    assert sorted(t.sessions) == ["s2", "s3", "s4"]
    assert (t.counters.num_expired, t.counters.num_evicted) == (1, 0)


def test_sessions_in_a_step_are_never_evicted_and_a_table_of_them_is_429():
    t = table(max_sessions=2)
    t.create("guess", "a", now=0.0)
    t.create("guess", "b", now=1.0)
    first = t.begin_step("s1", now=2.0)
    second = t.begin_step("s2", now=3.0)
    with pytest.raises(SessionLimit, match="every one in a step") as info:
        t.create("guess", "c", now=4.0)
    assert info.value.retry_after_s == 1.0 and t.counters.num_rejected == 1
    t.end_step(second, now=5.0)  # s2 is out of its step: evictable again, s1 is not
    assert t.create("guess", "c", now=6.0).id == "s3"
    assert sorted(t.sessions) == ["s1", "s3"] and first.num_in_step == 1
    t.end_step(first, now=7.0)
    assert t.get("s1", now=7.0).last_active == 7.0  # the step's end counts as activity


def test_decode_rejects_bad_bodies_with_clear_messages():
    with pytest.raises(ProtocolError, match="malformed JSON") as info:
        decode(b"{not json", ObservationRequest)
    assert info.value.status == 400
    with pytest.raises(ProtocolError, match="missing required field `action`"):
        decode(b'{"session": "s1"}', ObservationRequest)
    with pytest.raises(ProtocolError, match="Expected `str`, got `int`"):
        decode(b'{"session": 1, "action": "x"}', ObservationRequest)
    long = b'{"session": "s1", "action": "' + b"x" * (MAX_ACTION_CHARS + 1) + b'"}'
    with pytest.raises(ProtocolError, match="longer than the limit"):
        decode(long, ObservationRequest)


def run(coro):
    return asyncio.run(coro)


def test_in_process_client_plays_guess_and_pause_expiry_match_the_table():
    clock = FakeClock()
    client = InProcessEnvClient(EnvConfig(max_sessions=2, idle_ttl_s=TTL), clock=clock)

    async def scenario():
        started = await client.start("guess", "1 100", seed=3)
        from tiderl.env.guess import GuessEnv

        solver = GuessEnv()
        assert solver.reset("1 100", 3)[0] == started.observation
        for _ in range(20):
            action = solver.solve()
            solver.step(action)
            out = await client.step(started.session, action)
            if out.done:
                break
        assert out.done and out.reward == 1.0
        with pytest.raises(EnvClientError, match="episode is done") as info:
            await client.step(started.session, "guess 1")
        assert info.value.status == 409
        await client.end(started.session)
        a = await client.start("guess")
        await client.pause(a.session)
        with pytest.raises(EnvClientError, match="paused") as info:
            await client.step(a.session, "guess 5")
        assert info.value.status == 409
        b = await client.start("guess")
        c = await client.start("guess")  # a full table: b, idle longest and active, evicted
        with pytest.raises(EnvClientError, match=f"session '{b.session}': unknown") as info:
            await client.step(b.session, "guess 5")
        assert info.value.status == 404
        clock.now += TTL + 1
        with pytest.raises(EnvClientError, match=f"/observation on session '{c.session}'"):
            await client.step(c.session, "guess 5")  # expired: 404
        await client.resume(a.session)  # paused through the TTL: still there
        assert (await client.step(a.session, "guess 5")).done is False
        with pytest.raises(EnvClientError, match="unknown environment 'nope'") as info:
            await client.start("nope")
        assert info.value.status == 400

    run(scenario())


def test_in_process_client_serves_a_gym_factory_as_gym():
    pytest.importorskip("gymnasium")
    client = InProcessEnvClient(EnvConfig(), gym="tests.unit.test_envs:make_echo_env")

    async def scenario():
        assert (await client.health())["envs"] == ["guess", "gym",
                                                   "gym:tests.unit.test_envs:make_echo_env"]
        started = await client.start("gym", None, seed=0)
        out = await client.step(started.session, "hello")
        assert isinstance(out.observation, str)
        await client.end(started.session)

    run(scenario())


def test_an_environment_subclass_is_served_by_its_dotted_path():
    name = "tiderl.env.guess:GuessEnv"  # any importable Environment subclass works the same way
    client = InProcessEnvClient(EnvConfig(envs=[name]))

    async def scenario():
        started = await client.start(name, "between 1 and 4", seed=0)
        out = await client.step(started.session, "guess 2")
        assert isinstance(out.observation, str) and out.observation
        await client.end(started.session)

    run(scenario())
    with pytest.raises(ConfigError) as info:
        EnvConfig(envs=["nope"])
    assert info.value.key == "envs[0]" and "module:Class" in info.value.message


def test_a_session_in_a_step_longer_than_the_ttl_does_not_expire():
    """An agent's step lasts while its agent thinks and runs its tools: past the TTL it stays,
    and is idle (and may expire) from the step's end."""
    table: SessionTable[str] = SessionTable(max_sessions=4, idle_ttl_s=10.0)
    session = table.create("agent", "run", now=0.0)
    in_step = table.begin_step(session.id, now=1.0)
    assert table.expire(now=100.0) == [] and table.get(session.id, now=100.0) is session
    table.end_step(in_step, now=100.0)
    assert table.expire(now=105.0) == []
    assert table.expire(now=111.0) == [session.id]
