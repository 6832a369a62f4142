"""hosts.yaml validation (one line naming the key) and the pure node planner."""

from __future__ import annotations

import pytest

from tiderl.core.types import Role
from tiderl.launch.hosts import PORT_NAMES, HostsError, load_hosts, parse_hosts
from tiderl.launch.plan import (
    Endpoints,
    job_nodes,
    numbered_ports,
    plan_local,
    plan_nodes,
    rank_nodes,
    share_devices,
)
from tiderl.profile import load_profile

PORTS = dict(zip(PORT_NAMES, (5001, 5002, 5003, 5004, 5005), strict=True))


def _hosts(**extra):
    return parse_hosts({
        "defaults": {"user": "tide", "python": "/opt/venv/bin/python", "workdir": "/srv/t"},
        "nodes": [{"name": "a", "host": "10.0.0.1", "devices": 2},
                  {"name": "b", "host": "b.example", "address": "10.0.0.2", "port": 2222,
                   "devices": [1, 3], "python": "/usr/bin/python3.11",
                   "env": {"GLOO_SOCKET_IFNAME": "eth0"}}],
        **extra})


def test_defaults_apply_and_a_node_overrides_them():
    hosts = _hosts()
    a, b = hosts.nodes
    assert (a.user, a.port, a.python, a.workdir, a.devices) == (
        "tide", 22, "/opt/venv/bin/python", "/srv/t", (0, 1))
    assert (b.port, b.python, b.devices, b.reach, b.target) == (
        2222, "/usr/bin/python3.11", (1, 3), "10.0.0.2", "tide@b.example:2222")
    assert hosts.coordinator == "a" and hosts.env_node is None and hosts.port_base is None


@pytest.mark.parametrize(("data", "message"), [
    ({"nodes": []}, "nodes: expected a non-empty list of nodes"),
    ({"nodes": [{"devices": 1}]}, "nodes[0].host: expected a host name or address"),
    ({"nodes": [{"host": "h", "port": "x"}]}, "nodes[0].port: expected a port in 1..65535"),
    ({"nodes": [{"host": "h", "devices": 0}]}, "nodes[0].devices: expected a count >= 1"),
    ({"nodes": [{"host": "h", "devices": [0, 0]}]}, "nodes[0].devices: expected a count"),
    ({"nodes": [{"host": "h", "gpus": 2}]}, "nodes[0].gpus: unknown key"),
    ({"nodes": [{"host": "h"}], "coordinator": "z"}, "coordinator: no node named 'z'"),
    ({"nodes": [{"host": "h"}], "env": {"node": "z"}}, "env.node: no node named 'z'"),
    ({"nodes": [{"host": "h"}], "env": {"url": "ftp://x"}}, "env.url: expected an http(s) URL"),
    ({"nodes": [{"host": "h"}], "env": {"url": "http://x", "node": "h"}}, "env: give 'node'"),
    ({"nodes": [{"host": "h"}], "ports": {"base": 80}}, "ports.base: expected a port"),
    ({"nodes": [{"host": "h", "name": "n"}, {"host": "g", "name": "n"}]},
     "nodes[1].name: 'n' names two nodes"),
    ({"defaults": {"devices": 2}, "nodes": [{"host": "h"}]}, "defaults.devices: unknown key"),
    ({"nodes": [{"host": "h", "env": {"A B": 1}}]}, "nodes[0].env: expected a mapping"),
    ([1, 2], "expected a mapping with 'nodes'"),
])
def test_errors_are_one_line_naming_the_key(data, message):
    with pytest.raises(HostsError) as err:
        parse_hosts(data, "hosts.yaml")
    text = str(err.value)
    assert text.startswith("hosts.yaml: ") and message in text and "\n" not in text


BIG = "x" * 10_000_000


@pytest.mark.parametrize(("data", "key"), [
    ({"nodes": [{"host": "h", "port": BIG}]}, "nodes[0].port: expected a port in 1..65535"),
    ({"nodes": [{"host": "h", "devices": BIG}]}, "nodes[0].devices: expected a count"),
    ({"nodes": [{"host": "h", "name": BIG}], "coordinator": BIG + "y"},
     "coordinator: no node named 'xxx"),
    ({"nodes": [{"host": "h"}], "env": {"url": BIG}}, "env.url: expected an http(s) URL"),
    ({"nodes": [{"host": "h"}], "ports": {"base": BIG}}, "ports.base: expected a port"),
    ({"nodes": [{"host": "h", BIG: 1}]}, "nodes[0].xxx"),
])
def test_a_10_mb_value_is_an_error_under_the_bound_naming_the_key(data, key):
    with pytest.raises(HostsError) as err:
        parse_hosts(data, "hosts.yaml")
    text = str(err.value)
    assert text.startswith(f"hosts.yaml: {key}") and "\n" not in text, text[:2000]
    assert len(text) < 1000 and "… (10,000,00" in text, text[:2000]


def test_repeated_hosts_get_host_port_names(tmp_path):
    path = tmp_path / "hosts.yaml"
    path.write_text("nodes:\n  - {host: 127.0.0.1, port: 2201}\n"
                    "  - {host: 127.0.0.1, port: 2202}\n")
    assert [n.name for n in load_hosts(path).nodes] == ["127.0.0.1:2201", "127.0.0.1:2202"]
    path.write_text("nodes: [\n")
    with pytest.raises(HostsError, match="not valid YAML"):
        load_hosts(path)
    with pytest.raises(HostsError, match="cannot read"):
        load_hosts(tmp_path / "missing.yaml")


def test_ranks_fill_the_nodes_in_order_with_their_commands():
    profile = load_profile("local", ["runtime.num_ranks=4", "runtime.rollout_ranks=2",
                                     "runtime.device=cuda"])
    plan = plan_nodes(_hosts(env={"node": "b"}), profile, "j1", PORTS)
    by_name = {p.name: p for p in plan.processes}
    assert [p.name for p in plan.processes] == ["env", "coordinator", "rank0", "rank1", "rank2",
                                                "rank3"]
    assert [(p.host, p.device, p.role) for p in plan.ranks] == [
        ("a", "cuda:0", Role.ROLLOUT), ("a", "cuda:1", Role.ROLLOUT),
        ("b", "cuda:1", Role.ACTOR), ("b", "cuda:3", Role.ACTOR)]
    assert by_name["env"].host == "b" and by_name["coordinator"].host == "a"
    rank2 = by_name["rank2"]
    assert rank2.argv[:6] == ("/usr/bin/python3.11", "-m", "tiderl.runtime", "rank",
                              "--run-dir", "/srv/t/runs/j1")
    argv = " ".join(rank2.argv)
    assert "--bus tcp://10.0.0.1:5001" in argv and "--dist tcp://10.0.0.1:5005" in argv
    assert "--env-url http://10.0.0.2:5004" in argv and "--device cuda:1" in argv
    keys = {"TIDERL_JOB_KEYS": "/srv/t/runs/j1/keys"}  # its HTTP tokens come from there
    assert rank2.env == {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", **keys}
    assert by_name["env"].env["TIDERL_JOB_KEYS"] == "/srv/t/runs/j1/keys"
    # the coordinator ends a dead rank's environment sessions: it has the URL and the token
    assert by_name["coordinator"].env["TIDERL_JOB_KEYS"] == "/srv/t/runs/j1/keys"
    env_argv = " ".join(by_name["env"].argv)
    assert "--host 10.0.0.2 --port 5004" in env_argv
    coordinator = " ".join(by_name["coordinator"].argv)
    assert "--metrics-port 5003" in coordinator and "--env-url http://10.0.0.2:5004" in coordinator


def test_a_running_environment_service_is_used_not_started():
    profile = load_profile("local", ["runtime.num_ranks=3", "runtime.rollout_ranks=1"])
    plan = plan_nodes(_hosts(env={"url": "http://10.0.0.9:8100/"}), profile, "j1", PORTS)
    assert [p.kind for p in plan.processes][:2] == ["coordinator", "rank"]
    assert "--env-url http://10.0.0.9:8100 " in " ".join(plan.ranks[0].argv) + " "
    assert plan.ranks[0].env["OMP_NUM_THREADS"] == "1"  # CPU ranks: their thread count


def test_without_an_env_section_the_profiles_url_or_the_coordinators_node():
    profile = load_profile("local", ["runtime.num_ranks=3", "runtime.rollout_ranks=1"])
    plan = plan_nodes(_hosts(), profile, "j1", PORTS)
    assert [(p.name, p.host) for p in plan.processes[:2]] == [("env", "a"), ("coordinator", "a")]
    with_url = load_profile("local", ["runtime.num_ranks=3", "runtime.rollout_ranks=1",
                                      "env.url=http://10.0.0.8:8100"])
    plan = plan_nodes(_hosts(), with_url, "j1", PORTS)
    assert plan.processes[0].kind == "coordinator"
    assert "--env-url http://10.0.0.8:8100" in " ".join(plan.ranks[0].argv)


def test_the_nodes_a_job_uses_are_known_before_it_is_planned():
    """What the SSH launcher opens sessions to, before the ports (and so the plan) exist."""
    two = load_profile("local", ["runtime.num_ranks=2", "runtime.rollout_ranks=1"])
    assert rank_nodes(_hosts(), two) == ["a", "a"]
    assert job_nodes(_hosts(), two) == ["a"]
    assert job_nodes(_hosts(env={"node": "b"}), two) == ["b", "a"]
    three = load_profile("local", ["runtime.num_ranks=3", "runtime.rollout_ranks=1"])
    assert job_nodes(_hosts(coordinator="b"), three) == ["b", "a"]
    assert set(job_nodes(_hosts(), three)) == set(plan_nodes(_hosts(), three, "j1", PORTS).hosts)


@pytest.mark.parametrize(("num_ranks", "slots", "expected"), [
    (3, [0, 1, 2, 3], [0, 1, 2]), (4, [0], [0, 0, 0, 0]), (5, ["a", "b"], list("aaabb")),
    (6, [0, 1, 2, 3], [0, 0, 1, 1, 2, 3]),
])
def test_consecutive_ranks_share_a_device_where_there_are_fewer(num_ranks, slots, expected):
    assert share_devices(num_ranks, slots) == expected


def test_more_ranks_than_devices_share_them_over_gloo():
    profile = load_profile("local", ["runtime.num_ranks=5", "runtime.rollout_ranks=2",
                                     "runtime.device=cuda"])
    ranks = plan_nodes(_hosts(), profile, "j1", PORTS).ranks
    assert [(r.host, r.device, r.share) for r in ranks] == [
        ("a", "cuda:0", 2), ("a", "cuda:0", 2), ("a", "cuda:1", 1), ("b", "cuda:1", 1),
        ("b", "cuda:3", 1)]
    for r in ranks:
        argv = " ".join(r.argv)
        assert "--dist-backend gloo" in argv  # the world joins over one backend
        assert ("--memory-fraction 0.5" in argv) is (r.share == 2)


ONE_GPU = {"nodes": [{"name": "ws", "host": "127.0.0.1", "devices": 1}]}


def test_a_one_gpu_job_puts_every_rank_on_it_with_a_share_of_its_memory():
    embedded = load_profile("local", ["runtime.device=cuda"])
    ranks = plan_nodes(parse_hosts(ONE_GPU), embedded, "j1", PORTS).ranks
    assert [(r.device, r.share) for r in ranks] == [("cuda:0", 4)] * 4
    assert all("--memory-fraction 0.25" in " ".join(r.argv) for r in ranks)
    vllm = load_profile("local", ["runtime.device=cuda", "engine.backend=vllm",
                                  "model.path=/m", "engine.gpu_memory_utilization=0.6"])
    plan = plan_nodes(parse_hosts(ONE_GPU), vllm, "j1", numbered_ports(vllm, 5001))
    engines = [p for p in plan.processes if p.kind == "engine"]
    assert len(engines) == 4
    assert all("--gpu-memory-utilization 0.15" in " ".join(e.argv) for e in engines)
    assert all("--memory-fraction 0.1" in " ".join(r.argv) for r in plan.ranks)  # 0.4 / 4
    local = plan_local(embedded, num_devices=1)
    assert [(r.device, r.share) for r in local.ranks] == [("cuda:0", 4)] * 4
    two = plan_local(embedded, num_devices=2)
    assert [r.device for r in two.ranks] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]


def test_one_rank_per_device_keeps_nccl_and_no_cap():
    profile = load_profile("local", ["runtime.num_ranks=4", "runtime.device=cuda"])
    for r in plan_nodes(_hosts(), profile, "j1", PORTS).ranks:
        assert r.share == 1
        assert "--dist-backend" not in r.argv and "--memory-fraction" not in r.argv


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_a_sharded_trainer_on_a_shared_device_is_refused(backend):
    profile = load_profile("local", ["runtime.device=cuda", f"trainer.backend={backend}"])
    with pytest.raises(HostsError, match=rf"^trainer.backend {backend}: 4 ranks share a device"):
        plan_nodes(parse_hosts(ONE_GPU), profile, "j1", PORTS)


def test_the_local_plan_has_the_same_processes():
    profile = load_profile("local", ["runtime.num_ranks=3", "runtime.rollout_ranks=1"])
    local = plan_local(profile)
    nodes = plan_nodes(_hosts(), profile, "j1", PORTS)
    assert [(p.name, p.role) for p in local.processes] == [(p.name, p.role)
                                                            for p in nodes.processes]


def test_a_server_backend_gets_an_engine_server_per_rank_on_its_node_and_device():
    profile = load_profile("local", ["runtime.num_ranks=4", "runtime.rollout_ranks=2",
                                     "runtime.device=cuda", "engine.backend=http",
                                     "engine.server_args=[--set, engine.max_num_seqs=8]"])
    ports = {**PORTS, **{f"engine{r}": 6000 + r for r in range(4)}}
    plan = plan_nodes(_hosts(), profile, "j1", ports)
    assert [p.name for p in plan.processes] == [
        "env", "engine0", "engine1", "engine2", "engine3", "coordinator",
        "rank0", "rank1", "rank2", "rank3"]
    engines = [p for p in plan.processes if p.kind == "engine"]
    assert [(p.host, p.device, p.rank) for p in engines] == [
        ("a", "cuda:0", 0), ("a", "cuda:1", 1), ("b", "cuda:1", 2), ("b", "cuda:3", 3)]
    assert engines[2].argv[:5] == ("/usr/bin/python3.11", "-m", "tiderl.cli.main", "engine",
                                   "serve")
    # it reads the model and engine sections of its node's copy of the job's profile
    assert engines[2].argv[5:] == ("--profile", "/srv/t/runs/j1/profile.yaml", "--host",
                                   "127.0.0.1", "--port", "6002", "--device", "cuda:1",
                                   "--set", "engine.max_num_seqs=8")  # server_args last
    assert engines[2].env == {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
                              "TIDERL_JOB_KEYS": engines[2].run_dir + "/keys"}
    rank2 = " ".join(plan.ranks[2].argv)
    assert rank2.endswith("--engine-url http://127.0.0.1:6002")  # its own server, loopback


def test_given_engine_urls_are_attached_and_no_server_is_started():
    urls = "[http://10.0.0.5:8000/, http://10.0.0.6:8000, http://10.0.0.7:8000]"
    profile = load_profile("local", ["runtime.num_ranks=3", "runtime.rollout_ranks=1",
                                     "engine.backend=http", f"engine.urls={urls}"])
    plan = plan_nodes(_hosts(), profile, "j1", PORTS)
    assert "engine" not in {p.kind for p in plan.processes}
    assert [r.argv[-1] for r in plan.ranks] == [
        "http://10.0.0.5:8000", "http://10.0.0.6:8000", "http://10.0.0.7:8000"]
    embedded = plan_nodes(_hosts(), load_profile("local", ["runtime.num_ranks=3",
                                                           "runtime.rollout_ranks=1"]),
                          "j1", PORTS)
    assert all("--engine-url" not in r.argv for r in embedded.ranks)


def test_vllm_and_sglang_servers_get_their_engines_command_lines():
    base = ["runtime.num_ranks=2", "runtime.rollout_ranks=1", "runtime.device=cuda",
            "model.path=/models/qwen", "engine.max_num_seqs=48"]
    ports = {**PORTS, "engine0": 6000, "engine1": 6001}
    vllm = plan_nodes(_hosts(), load_profile("local", [*base, "engine.backend=vllm"]), "j1",
                      ports)
    engine1 = next(p for p in vllm.processes if p.name == "engine1")
    assert engine1.argv == (
        "/opt/venv/bin/vllm", "serve", "/models/qwen", "--host", "127.0.0.1", "--port", "6001",
        "--served-model-name", "tiderl", "--dtype", "float32", "--seed", "0",
        "--max-num-seqs", "48", "--max-num-batched-tokens", "2048", "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--scheduling-policy", "priority",
        "--enable-sleep-mode", "--gpu-memory-utilization", "0.5")
    assert engine1.env == {"CUDA_VISIBLE_DEVICES": "1", "VLLM_SERVER_DEV_MODE": "1"}
    offload = plan_nodes(_hosts(), load_profile("local", [*base, "engine.backend=vllm",
                                                          "engine.host_kv_gib=16"]), "j1", ports)
    assert offload.processes[1].argv[-2:] == ("--kv-offloading-size", "16.0")
    masked = plan_local(load_profile("local", [*base, "engine.backend=vllm"]), "/py", "/run",
                        Endpoints("127.0.0.1", "http://127.0.0.1:5004", "127.0.0.1", ports),
                        "4,5")
    # rank 1's cuda:1 is physical GPU 5: its server must be there too
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in masked.processes if p.kind == "engine"] == [
        "4", "5"]
    elsewhere = plan_nodes(_hosts(), load_profile("local", [
        *base, "engine.backend=vllm", "engine.server_python=/opt/vllm-env/bin/python"]), "j1",
        ports)
    assert elsewhere.processes[1].argv[0] == "/opt/vllm-env/bin/vllm"
    sglang = plan_nodes(_hosts(), load_profile("local", [*base, "engine.backend=sglang",
                                                         "engine.enable_prefix_caching=false"]),
                        "j1", ports)
    engine0 = next(p for p in sglang.processes if p.name == "engine0")
    assert engine0.argv == (
        "/opt/venv/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/qwen",
        "--host", "127.0.0.1", "--port", "6000", "--served-model-name", "tiderl",
        "--dtype", "float32", "--random-seed", "0", "--max-running-requests", "48",
        "--enable-metrics", "--enable-memory-saver", "--enable-priority-scheduling",
        "--schedule-low-priority-values-first", "--default-priority-value", "0",
        "--disable-radix-cache", "--mem-fraction-static", "0.5", "--base-gpu-id", "0")
    assert engine0.env == {}  # --base-gpu-id counts the devices it inherits, as the rank
    assert sglang.ranks[0].argv[-2:] == ("--engine-url", "http://127.0.0.1:6000")


def test_a_vllm_server_on_the_cpu_gets_the_kv_pool_exactly_and_no_sleep_mode(tmp_path):
    """vLLM's CPU backend: its pool is engine.kv_cache_tokens in blocks of engine.block_size
    rounded up to a multiple of 32 (it would reserve a share of all memory otherwise), its
    context what the pool holds less vLLM's null block (it refuses to start otherwise), or the
    model's where that is shorter, and --enable-sleep-mode stops its start."""
    profile = load_profile("local", ["runtime.num_ranks=2", "runtime.rollout_ranks=1",
                                     "model.path=/models/qwen", "engine.backend=vllm",
                                     "engine.kv_cache_tokens=4000", "engine.block_size=16",
                                     "runtime.threads_per_rank=1"])
    ports = {**PORTS, "engine0": 6000, "engine1": 6001}
    engine0 = next(p for p in plan_nodes(_hosts(), profile, "j1", ports).processes
                   if p.name == "engine0")
    argv = engine0.argv
    assert "--enable-sleep-mode" not in argv and "--gpu-memory-utilization" not in argv
    at = argv.index("--num-gpu-blocks-override")
    # its attention takes blocks of a multiple of 32 tokens: 4,000 tokens are 125 of them
    assert argv[at + 1] == "125" and argv[argv.index("--block-size") + 1] == "32"
    assert "--kv-cache-memory-bytes" in argv
    assert argv[argv.index("--max-model-len") + 1] == str(124 * 32)  # no config.json here
    assert engine0.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                           "OMP_NUM_THREADS": "1"}
    (tmp_path / "config.json").write_text('{"model_type": "llama", '
                                          '"max_position_embeddings": 512}')
    short = load_profile("local", ["runtime.num_ranks=2", "runtime.rollout_ranks=1",
                                   f"model.path={tmp_path}", "engine.backend=vllm"])
    argv = next(p for p in plan_nodes(_hosts(), short, "j1", ports).processes
                if p.name == "engine0").argv
    assert argv[argv.index("--max-model-len") + 1] == "512"
