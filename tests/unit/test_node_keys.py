"""Which key files the SSH launcher pushes to each node (tiderl.launch.remote.node_keys): a node
gets the pairs of its own ranks only, the coordinator's node every public key and the server
secret, and no node the operator's secret."""

from __future__ import annotations

from tiderl.launch.plan import LaunchPlan, ProcessSpec
from tiderl.launch.remote import node_keys

PLAN = LaunchPlan(processes=(
    ProcessSpec("env", "env", host="c"),
    ProcessSpec("coordinator", "coordinator", host="a"),
    ProcessSpec("rank0", "rank", host="a", rank=0),
    ProcessSpec("rank1", "rank", host="b", rank=1),
    ProcessSpec("engine1", "engine", host="b", rank=1),
    ProcessSpec("rank2", "rank", host="b", rank=2),
))


def test_each_node_gets_its_own_ranks_pairs_and_only_the_coordinators_node_more() -> None:
    assert node_keys(PLAN, "a", coordinator="a") == [
        "server.public", "rank-0.public", "rank-0.secret", "http.secret", "server.secret",
        "operator.public", "rank-1.public", "rank-2.public"]
    assert node_keys(PLAN, "b", coordinator="a") == [
        "server.public", "rank-1.public", "rank-1.secret", "rank-2.public", "rank-2.secret",
        "http.secret"]
    assert node_keys(PLAN, "c", coordinator="a") == ["server.public", "http.secret"]


def test_a_node_with_the_coordinator_only_gets_no_rank_secret() -> None:
    plan = LaunchPlan(processes=(ProcessSpec("coordinator", "coordinator", host="c"),
                                 ProcessSpec("rank0", "rank", host="a", rank=0)))
    # the HTTP secret: the coordinator ends a dead rank's environment sessions
    assert node_keys(plan, "c", coordinator="c") == [
        "server.public", "http.secret", "server.secret", "operator.public", "rank-0.public"]
    every = {f for node in ("a", "c") for f in node_keys(plan, node, coordinator="c")}
    assert "operator.secret" not in every
