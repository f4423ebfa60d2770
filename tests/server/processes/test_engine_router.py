"""How requests are spread over data-parallel engines (server/engine_router.py), how their stats
add up, and what each replica's engine config holds."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.parallel.group import rank_device
from deltaserve.engine.requests.cache_salt import salt_digest
from deltaserve.engine.requests.request import salted_id
from deltaserve.server.engine_client import merge_stats
from deltaserve.server.engine_router import EngineRouter, SharedLoad, SharedRoutes, prefix_keys


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefix_keys_are_chained_per_stride() -> None:
    a, b = prompt(0, 200), prompt(1, 200)
    keys = prefix_keys(a, 64)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert prefix_keys(a[:130] + b[130:], 64)[:2] == keys[:2]  # the same first 128 tokens
    assert prefix_keys(b[:10] + a[10:], 64)[0] != keys[0]  # a change early changes every later key
    assert prefix_keys(b[:10] + a[10:], 64)[2] != keys[2]
    assert prefix_keys(a[:63], 64) == []
    long = prompt(4, 8192 + 3000)  # 128 keys to 8,192 tokens, then one a 1,024: 130
    keys = prefix_keys(long)
    assert len(keys) == 130 and prefix_keys(long[: 8192 + 2048]) == keys
    assert prefix_keys(long[: 8192 + 2047]) == keys[:129]


def test_a_salted_prompt_routes_by_its_own_salts_prefixes() -> None:
    """vLLM's cache_salt: an engine's cache serves a salted prompt only what the same salt cached,
    so the router follows the salt's history, not the same tokens' unsalted one."""
    a = prompt(0, 200)
    assert prefix_keys(a, 64, salt="x") != prefix_keys(a, 64) != prefix_keys(a, 64, salt="y")
    assert prefix_keys(a, 64, salt="x") == prefix_keys(a, 64, salt="x")  # a digest: the same in every process
    router = EngineRouter(2)
    assert router.pick([a]) == 0
    router.load[0] += 1
    assert router.pick([a], salt="x") == 1  # the least busy: engine 0 holds only the unsalted prefix
    router.load[1] += 2
    assert router.pick([a + prompt(1, 64)], salt="x") == 1  # where its salt's history went
    assert router.pick([a + prompt(2, 64)]) == 0


def test_one_salt_digest_keys_the_radix_tree_and_the_router_which_stays_torch_free() -> None:
    """The radix tree's salted first id and the router's salted prefix hashes start from one digest
    (its first 64 bits for the router, as before); the router's HTTP processes load no torch."""
    code = "import sys\nimport deltaserve.server.engine_router\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
    digest, a = salt_digest("tenant-a"), prompt(0, 64)
    assert prefix_keys(a, 64, salt="tenant-a") == [hash((digest >> 64, tuple(a)))]
    assert salted_id("tenant-a", 5) == -(1 << 48) - ((digest << 64) | 5)


def test_unrelated_prompts_go_to_the_least_busy_engine_in_turn() -> None:
    router = EngineRouter(3)
    picks = [router.pick([prompt(i, 100)]) for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]  # no load: taken in turn
    router.load = [5, 1, 3]
    assert router.pick([prompt(10, 100)]) == 1


def test_a_longer_prompt_of_the_same_history_goes_back_to_its_engine() -> None:
    router = EngineRouter(2)
    first = prompt(0, 300)
    engine = router.pick([first])
    router.load[engine] += 1
    other = router.pick([prompt(1, 300)])
    assert other != engine
    router.load[engine] += 2  # busier, within the slack
    assert router.pick([first + prompt(2, 50)]) == engine
    assert router.pick([first[:128] + prompt(3, 200)]) == engine  # a shorter shared part still counts


def test_the_deepest_match_wins_over_a_shared_start() -> None:
    router = EngineRouter(2)
    system = prompt(0, 128)
    a, b, c = (system + prompt(i, 200) for i in (1, 2, 3))
    assert router.pick([a]) == 0
    router.load[0] += 1
    assert router.pick([b]) == 0  # the shared start is cached there, and 0 is not much busier
    router.load = [6, 0]
    assert router.pick([c]) == 1  # too busy: the least busy takes it (and the shared start's keys)
    router.load = [1, 1]
    assert router.pick([a + prompt(4, 64)]) == 0  # each chat's own history, not the shared start
    assert router.pick([b + prompt(5, 64)]) == 0
    assert router.pick([c + prompt(6, 64)]) == 1


def test_a_busy_engine_loses_its_prefixes_to_the_least_busy() -> None:
    router = EngineRouter(2)
    history = prompt(0, 256)
    assert router.pick([history]) == 0
    router.load = [4, 0]
    assert router.pick([history + prompt(1, 64)]) == 0  # within the least busy's load + SLACK
    router.load = [5, 0]
    assert router.pick([history + prompt(1, 64)]) == 1
    router.load = [0, 0]
    assert router.pick([history + prompt(2, 64)]) == 1  # its history is recorded there now
    router.load = [20, 29]  # within the relative slack: 20 x 1.5
    assert router.pick([history + prompt(3, 64)]) == 1
    router.load = [20, 31]
    assert router.pick([history + prompt(3, 64)]) == 0


@pytest.mark.parametrize("max_keys, back_to_0", [(8, False), (64, True)])
def test_prefixes_are_forgotten_oldest_first(max_keys: int, back_to_0: bool) -> None:
    router = EngineRouter(2, max_keys=max_keys)
    old = prompt(0, 256)  # 4 keys
    assert [router.pick([p]) for p in (old, prompt(1, 256), prompt(2, 256))] == [0, 1, 0]
    assert len(router.routes) == min(max_keys, 12)
    # remembered, it goes back to 0; forgotten, it is taken in turn (1)
    assert (router.pick([old]) == 0) is back_to_0


def test_one_engine_takes_everything() -> None:
    router = EngineRouter(1)
    assert {router.pick([prompt(i, 100)]) for i in range(5)} == {0}


def test_merged_stats_add_counts_and_recompute_rates() -> None:
    one = {
        "running": 3,
        "kv_pages_used": 10,
        "prompt_tokens_total": 100,
        "prefix_cache_hit_tokens": 30,
        "prefix_cache_query_tokens": 100,
        "prefix_cache_hit_rate": 0.3,
        "prefill_step_fixed_ms": 4.0,
    }
    two = {
        "running": 1,
        "kv_pages_used": 2,
        "prompt_tokens_total": 300,
        "prefix_cache_hit_tokens": 0,
        "prefix_cache_query_tokens": 300,
        "prefix_cache_hit_rate": 0.0,
        "prefill_step_fixed_ms": 6.0,
    }
    merged = merge_stats([one, two])
    assert merged["running"] == 4 and merged["kv_pages_used"] == 12 and merged["prompt_tokens_total"] == 400
    assert merged["prefix_cache_hit_rate"] == pytest.approx(30 / 400)
    assert merged["prefill_step_fixed_ms"] == pytest.approx(5.0)
    assert merged["engines"] == [one, two]


def config(**kwargs) -> EngineConfig:
    return EngineConfig(model="unused", **kwargs)


def test_each_replica_takes_the_gpus_after_the_ones_before() -> None:
    base = config(device="cuda", tensor_parallel_size=2, data_parallel_size=3)
    replicas = [base.data_parallel_replica(r) for r in range(3)]
    assert [r.device for r in replicas] == ["cuda:0", "cuda:2", "cuda:4"]
    assert [r.data_parallel_rank for r in replicas] == [0, 1, 2]
    assert [str(rank_device(replicas[1], rank)) for rank in (0, 1)] == ["cuda:2", "cuda:3"]
    shifted = config(device="cuda:4", data_parallel_size=2).data_parallel_replica(1)
    assert shifted.device == "cuda:5"
    ports = config(device="cpu", data_parallel_size=2, master_port=29500)
    assert [ports.data_parallel_replica(r).master_port for r in (0, 1)] == [29500, 29501]
    assert config(device="cpu", data_parallel_size=2).data_parallel_replica(1).device == "cpu"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"data_parallel_size": 0},
        {"data_parallel_size": 2, "data_parallel_rank": 2},
        {"data_parallel_size": 2, "nnodes": 2, "tensor_parallel_size": 2, "master_port": 29500},
    ],
)
def test_impossible_replicas_are_refused(kwargs) -> None:
    with pytest.raises(ValueError, match="data"):
        config(device="cpu", **kwargs)


def test_other_methods_ignore_the_prompt() -> None:
    history = prompt(0, 256)
    shortest = EngineRouter(2, "shortest_queue")
    assert shortest.pick([history]) == 0
    shortest.load = [0, 0]
    assert shortest.pick([history]) == 1  # in turn among the least busy, not back to its history
    shortest.load = [3, 1]
    assert shortest.pick([history]) == 1
    turns = EngineRouter(3, "round_robin")
    turns.load = [9, 0, 0]
    assert [turns.pick([history]) for _ in range(4)] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="cache_aware"):
        EngineRouter(2, "random")


def test_the_offline_llm_refuses_data_parallelism(builtin_path: str) -> None:
    from deltaserve import LLM

    with pytest.raises(ValueError, match="deltaserve serve --data-parallel-size"):
        LLM(builtin_path, data_parallel_size=2)


def test_http_processes_share_where_each_prefix_went(tmp_path) -> None:
    """Two routers over one table file, as two HTTP processes: a chat's next turn that reaches
    the other process goes back to its engine; a table of few slots forgets, never misroutes."""
    path = str(tmp_path / "routes")
    SharedRoutes(path, create=True, slots=4096)
    first, second = (EngineRouter(2, routes=SharedRoutes(path, slots=4096)) for _ in range(2))
    history = prompt(0, 256)
    assert first.pick([history]) == 0
    first.load = [3, 0]  # busier, within the slack
    second.load = [0, 0]  # the second knows nothing of the first's load...
    assert second.pick([history + prompt(1, 64)]) == 0  # ... but where the history went
    other = prompt(2, 256)
    second.load = [1, 0]
    assert second.pick([other]) == 1  # unrelated: the least busy
    assert first.pick([other + prompt(3, 64)]) == 1
    tiny = SharedRoutes(str(tmp_path / "tiny"), create=True, slots=1)
    router = EngineRouter(2, routes=tiny)
    picks = [router.pick([prompt(i, 128)]) for i in range(4)]  # each overwrites the one slot
    assert picks == [0, 1, 0, 1] and router.pick([prompt(3, 128) + [1] * 64]) == 1


def test_http_processes_balance_the_whole_servers_load(tmp_path) -> None:
    """Two HTTP processes' routers over one load file: each sees what the other has in flight, so
    one stream on each process lands on each engine, not both on engine 0 (each process's own
    count says both are idle), and a gone request frees its engine for both."""
    path = str(tmp_path / "load")
    SharedLoad(path, 0, 2, 2, create=True)
    first, second = (EngineRouter(2, "shortest_queue", shared_load=SharedLoad(path, i, 2, 2)) for i in (0, 1))
    a = first.pick([prompt(0, 100)])
    first.count(a, 1)
    b = second.pick([prompt(1, 100)])
    second.count(b, 1)
    assert (a, b) == (0, 1)
    assert SharedLoad(path, 0, 2, 2).table.tolist() == [[1, 0], [0, 1]]  # each process its own row
    second.count(b, 1)  # engine 1 busier now, by the second's count
    assert first.pick([prompt(2, 100)]) == 0
    first.count(0, 1)
    first.count(0, 1)  # engine 0 busier: 3 against 2
    assert second.pick([prompt(3, 100)]) == 1
    second.count(1, -1)
    second.count(1, -1)
    assert SharedLoad(path, 0, 2, 2).totals() == [3, 0]
    assert second.pick([prompt(4, 100)]) == 1


class Replica:
    """A stand-in engine that stages new weights, or refuses them, and records the verdict."""

    model_info = {"model": "m"}
    max_model_len, eos_token_ids, vocab_size = 64, [0], 16

    def __init__(self, refuse: str | None) -> None:
        self.refuse, self.served = refuse, None

    def has_unfinished_requests(self) -> bool:
        return False

    def step(self) -> list:
        return []

    def stage_weights(self, path: str, load_format: str) -> str | None:
        return self.refuse

    def finish_weights(self, commit: bool, version: str | None = None) -> None:
        self.served = commit


@pytest.mark.parametrize("refusals", [(None, None), (None, "the checkpoint at x is another model")])
def test_replicas_serve_new_weights_together_or_not_at_all(refusals) -> None:
    import asyncio

    from deltaserve.server.engine_client import EngineClient, EngineHandle

    replicas = [Replica(r) for r in refusals]
    handles = [EngineHandle.in_thread(r) for r in replicas]
    client = EngineClient(handles)

    async def run() -> None:
        await client.start()
        try:
            if refusals[1] is None:
                await client.update_weights("x", "auto", None)
            else:
                with pytest.raises(ValueError, match="another model"):
                    await client.update_weights("x", "auto", None)
        finally:
            await client.shutdown()

    asyncio.run(run())
    # one replica's refusal: neither serves the new weights (the other staged them, then dropped them)
    assert [r.served for r in replicas] == [refusals[1] is None] * 2


class Busy(Replica):
    """A stand-in engine with a request of its own running until `running` is cleared: a weight
    update waits for it, holding what comes meanwhile."""

    def __init__(self) -> None:
        super().__init__(None)
        self.running, self.added = True, []

    def has_unfinished_requests(self) -> bool:
        return self.running

    def add_request(self, request_id: str, *_: object) -> None:
        self.added.append(request_id)

    def abort_request(self, request_id: str) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"running": int(self.running), "waiting": 0}


def test_requests_held_by_an_update_count_as_waiting_until_let_in() -> None:
    """The engine's stats (what /metrics shows) count the requests an update holds as waiting;
    one that /abort_request named stops counting, and once the update lets them in none does."""
    import asyncio

    from deltaserve import SamplingParams
    from deltaserve.server.engine_client import EngineClient, EngineHandle

    engine = Busy()
    client = EngineClient(EngineHandle.in_thread(engine))
    params = SamplingParams(max_tokens=1)

    async def run() -> None:
        await client.start()
        try:
            update = asyncio.ensure_future(client.update_weights("x", "auto", None))
            while not client.num_calls:  # its stage_weights is sent: the adds after it are held
                await asyncio.sleep(0)
            adds = [
                asyncio.ensure_future(client.add([(rid, [1, 2], params)])) for rid in ("keep-1", "gone-1")
            ]
            stats = await client.stats()
            assert (stats["running"], stats["waiting"]) == (1, 2) and engine.added == []
            await client.abort_where("gone-")
            assert (await client.stats())["waiting"] == 1
            engine.running = False
            await update
            await asyncio.gather(*adds)
            assert engine.added == ["keep-1", "gone-1"] and engine.served is True
            assert (await client.stats())["waiting"] == 0
        finally:
            await client.shutdown()

    asyncio.run(run())
