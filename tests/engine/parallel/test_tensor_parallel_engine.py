"""Tensor parallelism in the engine (gloo on CPU, fp32): greedy tokens at TP = 2 equal TP = 1 and
transformers' through mixed batches, chunked prefill, radix hits, n-gram speculative decoding,
overlap scheduling and a Kimi-Linear checkpoint; every rank's device state follows rank 0's
writes (state digests); workers end with the engine; a missing rank is a clear error."""

from __future__ import annotations

import os
import time

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.errors import EngineDeadError
from deltaserve.models.layers.common import Experts

# Tensor parallelism: ranks spawned as processes (tests/models/test_tensor_parallel.py stays fast)
pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


def make_llm(path: str, tp: int, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 32)  # prompts span several prefill chunks
    kw.setdefault("num_kv_pages", 160)
    kw.setdefault("max_model_len", 512)
    kw.setdefault("max_running_requests", 8)
    return LLM(path, dtype="float32", device="cpu", page_size=16, tensor_parallel_size=tp, **kw)


def prompts_of(lengths: list[int], seed: int, repeat: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 160, (n,), generator=g).tolist() * repeat for n in lengths]


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(llm: LLM, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def tp1(path: str, prompts: list[list[int]], max_tokens: int = 12, **kw) -> list[list[int]]:
    with make_llm(path, 1, **kw) as llm:
        return run(llm, prompts, max_tokens)


def disagreements(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[str]:
    """Where a worker's device state departs from rank 0's. Each rank holds other heads, so the
    values differ; but a replayed slot copy makes two rows equal on every rank, and a row never
    written stays zero on every rank: which rows equal which must be the same on both."""
    bad = [] if torch.equal(ours["page_table"], theirs["page_table"]) else ["page_table"]
    for name in ours:
        if name != "page_table" and _partition(ours[name]) != _partition(theirs[name]):
            bad.append(name)
    return bad


def _partition(rows: torch.Tensor) -> list[int]:
    """Each row's (sum, absolute sum) digest named by the first row within 1e-6 of its size: a copy
    is exact, but the same prefix computed again in another batch can come out bit-equal on one
    rank and a rounding apart on another (the CPU's matmul blocking decides), which is no
    departure. The tolerance scales with the absolute sum, since a signed sum may be near zero."""
    firsts: list[int] = []
    out = []
    for i, row in enumerate(rows):
        tol = 1e-6 * float(row.abs().max()) + 1e-12
        same = next((j for j in firsts if float((row - rows[j]).abs().max()) <= tol), None)
        if same is None:
            firsts.append(i)
        out.append(i if same is None else same)
    return out


def assert_ranks_agree(llm: LLM) -> None:
    """Every worker replayed rank 0's device-state writes."""
    digests = llm.engine.tensor_parallel_digests()
    assert len(digests) == 2
    assert disagreements(*digests) == []


def test_state_check_sees_a_missed_copy_not_a_rounding():
    """The check itself: a rounding apart on a row whose signed sum is near zero is no departure,
    a slot copy that one rank missed is."""
    page_table = torch.zeros(2, 2, dtype=torch.int32)
    rank0 = torch.tensor([[0.01, 27.5], [3.0, 9.0], [3.0, 9.0]], dtype=torch.float64)
    worker = torch.tensor([[0.02, 31.0], [1e-3, 7.0], [1e-3, 7.0]], dtype=torch.float64)
    rounded = worker.clone()
    rounded[2, 0] += 5e-8
    assert (
        disagreements({"page_table": page_table, "s": rank0}, {"page_table": page_table, "s": rounded}) == []
    )
    missed = worker.clone()
    missed[2] = torch.tensor([0.5, 2.0])
    assert disagreements({"page_table": page_table, "s": rank0}, {"page_table": page_table, "s": missed}) == [
        "s"
    ]


@pytest.fixture(scope="module")
def qwen(make_checkpoint) -> str:
    return make_checkpoint("qwen3_5")


def test_tp2_greedy_equals_tp1_and_transformers(qwen, hf_reference, pools_held):
    # mixed lengths, two prompts longer than a 32-token prefill chunk
    prompts = prompts_of([5, 40, 17, 100], seed=1)
    ref = tp1(qwen, prompts)
    assert ref == hf_reference(qwen, prompts, 12)
    with make_llm(qwen, 1) as whole:
        num_params = whole.engine.model_info["num_params"]
    with make_llm(qwen, 2) as llm:
        assert run(llm, prompts) == ref
        assert_ranks_agree(llm)
        assert not pools_held(llm)
        # a rank holds a shard, but the model it serves is the whole one
        assert llm.engine.model_info["num_params"] == num_params


def test_radix_hit_at_tp2_reads_the_cached_state_on_every_rank(qwen):
    shared = prompts_of([96], seed=2)[0]
    first, second = shared + [3, 4, 5], shared + [9, 8, 7, 6]
    ref = [tp1(qwen, [first])[0], tp1(qwen, [second])[0]]
    with make_llm(qwen, 2) as llm:
        a = llm.generate([{"prompt_token_ids": first}], greedy(), use_tqdm=False)[0]
        b = llm.generate([{"prompt_token_ids": second}], greedy(), use_tqdm=False)[0]
        assert b.num_cached_tokens >= 64  # the hit: the snapshot copied into the slot on every rank
        assert [a.outputs[0].token_ids, b.outputs[0].token_ids] == ref
        assert_ranks_agree(llm)


def test_a_write_not_replayed_changes_what_rank_0_computes(qwen):
    """A writer that forgets to record: rank 0's snapshot copies kept from the workers leave rank
    1 computing a prefix-cache hit from another state, and the hit's first log-probability (which
    sums every rank's heads) moves away from TP=1's; replayed, it stays with it."""
    shared = prompts_of([96], seed=3)[0]
    probe = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=0)

    def hit_logprob(llm: LLM, drop_log: bool) -> float:
        run(llm, [shared + [1, 2]])
        if drop_log:
            llm.engine.runner.state_pool.log = None
        hit = llm.generate([{"prompt_token_ids": shared + [5]}], probe, use_tqdm=False)[0]
        assert hit.num_cached_tokens > 0
        return hit.outputs[0].logprobs[0].logprob

    with make_llm(qwen, 1) as llm:
        ref = hit_logprob(llm, False)
    with make_llm(qwen, 2) as llm:
        replayed = hit_logprob(llm, False)
        assert_ranks_agree(llm)
    with make_llm(qwen, 2) as llm:
        dropped = hit_logprob(llm, True)
    print(f"hit log-prob: TP=1 {ref:.9f}, TP=2 {replayed:.9f}, TP=2 without the copies {dropped:.9f}")
    # a tiny random model's state weighs little on its logits: the gap is small but far above
    # the rounding of a two-rank all-reduce
    assert abs(replayed - ref) < 2e-6
    assert abs(dropped - ref) > 2e-5


def test_ngram_speculation_at_tp2(qwen):
    prompts = prompts_of([6, 9, 40], seed=4, repeat=3)  # repeats: the n-gram drafts get accepted
    ref = tp1(qwen, prompts, 20)
    with make_llm(qwen, 2, speculative_config=NGRAM) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(20), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert sum(o.num_accepted_tokens for o in outs) > 0  # windows were committed
        assert_ranks_agree(llm)


def test_overlap_scheduling_at_tp2(qwen):
    """Decode inputs filled from rank 0's sampled tokens on the device reach the workers."""
    shared = prompts_of([70], seed=5)[0]
    prompts = [*prompts_of([3, 33], seed=6), shared + [1], shared + [2, 3]]
    ref = tp1(qwen, prompts, 16)
    with make_llm(qwen, 2, enable_overlap_schedule=True) as llm:
        assert run(llm, prompts[:2], 16) == ref[:2]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[2:]], greedy(16), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref[2:]
        assert_ranks_agree(llm)


def test_kimi_linear_at_tp2(small_kimi_checkpoint):
    prompts = prompts_of([7, 50, 23], seed=7)
    ref = tp1(small_kimi_checkpoint, prompts)
    with make_llm(small_kimi_checkpoint, 2) as llm:
        assert run(llm, prompts) == ref
        assert_ranks_agree(llm)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_shutdown_ends_the_workers_and_a_lost_worker_kills_the_engine(qwen):
    llm = make_llm(qwen, 2)
    workers = llm.engine.ranks.workers
    assert workers is not None and all(_alive(p) for p in workers.pids)
    llm.shutdown()
    assert not any(_alive(p) for p in workers.pids)
    # the process group is gone with it: another tensor-parallel engine starts in this process
    llm = make_llm(qwen, 2)
    try:
        workers = llm.engine.ranks.workers
        assert workers is not None
        os.kill(workers.pids[0], 9)
        deadline = time.monotonic() + 10
        while llm.engine.dead_reason is None:
            assert time.monotonic() < deadline, "the lost worker went unnoticed"
            time.sleep(0.05)
        assert "rank 1" in llm.engine.dead_reason
        with pytest.raises(EngineDeadError, match="rank 1"):
            run(llm, prompts_of([5], seed=8))
    finally:
        llm.shutdown()


def test_heartbeats_change_nothing_and_a_rank_that_takes_none_is_a_dead_engine(qwen, monkeypatch):
    """An idle rank 0 sends its workers a no-op message every second (the server's loop calls
    `heartbeat`): between and after batches they leave the tokens and every rank's state as they
    were. A rank that does not take one (stopped here, as a hung rank or an unreachable node would
    be) ends the engine after the heartbeat's timeout instead of hanging rank 0."""
    import signal

    from deltaserve.engine.parallel import step_sync

    prompts = prompts_of([5, 40], seed=9)
    ref = tp1(qwen, prompts)
    monkeypatch.setattr(step_sync, "HEARTBEAT_S", 0.0)  # every call sends one
    llm = make_llm(qwen, 2)
    try:
        channel = llm.engine.runner.channel
        sent = []
        monkeypatch.setattr(
            channel, "send", lambda m, *a: (sent.append(m.kind), type(channel).send(channel, m, *a))
        )
        for _ in range(3):
            llm.engine.heartbeat()
        assert run(llm, prompts) == ref
        llm.engine.heartbeat()
        assert run(llm, prompts) == ref
        assert sent.count("beat") == 4
        assert_ranks_agree(llm)
        workers = llm.engine.ranks.workers
        assert workers is not None
        (worker,) = workers.pids
        monkeypatch.setattr(step_sync, "HEARTBEAT_TIMEOUT_S", 1.0)
        os.kill(worker, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError, match="did not take rank 0's heartbeat in 1 s"):
                llm.engine.heartbeat()
            assert time.monotonic() - t0 < 15  # the 1 s set above, not the default 30 s
            assert llm.engine.dead_reason is not None and "heartbeat" in llm.engine.dead_reason
        finally:
            os.kill(worker, signal.SIGKILL)
    finally:
        llm.shutdown()


def test_an_llm_dropped_without_shutdown_ends_its_workers(qwen):
    """vLLM's `del llm; gc.collect()`: the workers stop and the process group goes, so that
    another tensor-parallel LLM starts in this process (the thread that watches the workers held
    the engine, which then stayed alive, its workers with it)."""
    import gc

    llm = make_llm(qwen, 2)
    expected = run(llm, prompts_of([7], seed=3))
    workers = llm.engine.ranks.workers
    assert workers is not None
    pids = workers.pids
    del llm, workers
    gc.collect()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, "the dropped engine's workers still run"
        time.sleep(0.05)
    with make_llm(qwen, 2) as llm:
        assert run(llm, prompts_of([7], seed=3)) == expected


def image_prompts() -> list[dict]:
    """Prompts with one and two images of different sizes (placeholders the engine expands), and
    a third that repeats the first's image under another text tail."""
    import numpy as np
    from PIL import Image

    def image(seed: int, size: tuple[int, int]) -> Image.Image:
        rng = np.random.default_rng(seed)
        return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))

    image_id, start, end = 150, 152, 153  # tests/conftest.py's vision checkpoint
    text = prompts_of([9, 4, 6, 5], seed=7)
    one, two, three = image(1, (24, 16)), image(2, (40, 32)), image(3, (16, 16))
    return [
        {
            "prompt_token_ids": text[0] + [start, image_id, end] + text[1],
            "multi_modal_data": {"image": [one]},
        },
        {
            "prompt_token_ids": text[2] + [start, image_id, end, 7, start, image_id, end] + text[3],
            "multi_modal_data": {"image": [two, three]},
        },
        {
            "prompt_token_ids": text[0] + [start, image_id, end] + text[3],
            "multi_modal_data": {"image": [one]},
        },
    ]


def test_images_at_tp2_equal_tp1(vision_checkpoint, pools_held):
    """Rank 0's vision tower embeds the images and its embeddings reach every rank with the step:
    the tokens of TP = 1 (held to transformers' in tests/models/test_image_input.py), through
    prefill chunks that cut an image and a prefix-cache hit on the same image."""
    prompts = image_prompts()

    def tokens(llm: LLM) -> tuple[list[list[int]], int]:
        first = llm.generate(prompts[:2], greedy(8), use_tqdm=False)
        hit = llm.generate(prompts[2:], greedy(8), use_tqdm=False)[0]
        return [o.outputs[0].token_ids for o in [*first, hit]], hit.num_cached_tokens

    kw = dict(max_num_batched_tokens=16, chunked_prefill_size=16)
    with make_llm(vision_checkpoint, 1, **kw) as llm:
        ref, _ = tokens(llm)
    with make_llm(vision_checkpoint, 2, **kw) as llm:
        assert llm.engine.model_info["images"].get("processor")  # not refused
        got, cached = tokens(llm)
        assert got == ref
        assert cached >= 16  # the first prompt's image, served from the cache on every rank
        assert_ranks_agree(llm)
        assert not pools_held(llm)


def test_weights_update_on_every_rank(qwen, make_checkpoint):
    """update_weights_from_disk at TP = 2: every rank stages its slice, then all copy, giving TP =
    1's tokens for the new checkpoint; another model's checkpoint is refused on every rank alike."""
    second = make_checkpoint("qwen3_5", seed=1)
    prompts = prompts_of([5, 40, 17], seed=4)
    with make_llm(qwen, 2) as llm:
        before = run(llm, prompts)
        with pytest.raises(ValueError, match="intermediate_size"):
            llm.update_weights_from_disk(make_checkpoint("qwen3_5", intermediate_size=40))
        assert run(llm, prompts) == before
        assert llm.engine.stage_weights(second) is None  # staged on both ranks, then dropped on both
        llm.engine.finish_weights(commit=False)
        assert run(llm, prompts) == before
        llm.update_weights_from_disk(second)
        assert run(llm, prompts) == tp1(second, prompts)
        assert_ranks_agree(llm)


def test_a_missing_rank_is_a_clear_error_not_a_hang(qwen, master_port):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rendezvous .* timed out after 2 s: 0 of the other 1 ranks"):
        make_llm(qwen, 2, nnodes=2, master_port=master_port, distributed_timeout_s=2)
    assert time.monotonic() - t0 < 30


def test_a_master_port_in_use_says_so():
    """Rank 0 cannot listen on a --master-port that another server's rendezvous holds: it failed at
    once, but said that rank 0 "could not reach rank 0 in 300 s"."""
    import socket

    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.parallel.group import init_rank

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = EngineConfig(model="m", device="cpu", tensor_parallel_size=2, master_port=port)
        with pytest.raises(RuntimeError) as caught:
            init_rank(config, 0, port, torch.device("cpu"))
    message = str(caught.value)
    assert f"rank 0 could not listen on 127.0.0.1:{port}" in message and "--master-port" in message, message
    assert "could not reach" not in message, message


def test_rank_0_listens_on_its_port_before_its_workers_are_told_it(monkeypatch):
    """Without --master-port, rank 0 lets the system pick its store's port while binding it, then
    starts its workers with that port: it picked a free port, released it and bound it again after
    starting them, and any process could take the port in between."""
    import socket

    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.parallel import ranks

    told: dict[str, object] = {}

    class Workers:  # stands in for the worker processes: says whether the port it is given listens
        def __init__(self, config, local, port) -> None:
            told["port"] = port
            with socket.socket() as probe:
                told["listening"] = probe.connect_ex(("127.0.0.1", port)) == 0

        def exited(self, wait_s: float = 0.0) -> str:
            return "tensor-parallel rank 1 exited with code 1"

        def stop(self, timeout: float) -> None:
            pass

    monkeypatch.setattr(ranks, "WorkerProcesses", Workers)
    config = EngineConfig(model="m", device="cpu", tensor_parallel_size=2)
    with pytest.raises(RuntimeError, match="rank 1 exited with code 1 before joining"):
        ranks.Ranks(config, lambda why: None)
    assert told["port"] != 0 and told["listening"] is True, told


def test_a_node_that_cannot_reach_rank_0_says_so_in_one_line(master_port):
    """A headless node's rank with nothing listening at --master-addr:--master-port: one error
    line, without the C++ stack trace torch's store client logged before it raised, nor a Python
    traceback."""
    import logging
    import pickle
    import subprocess
    import sys

    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.parallel.worker import WorkerArgs

    port = master_port  # held unlistened to: nothing answers there
    config = EngineConfig(
        model="m", device="cpu", tensor_parallel_size=2, nnodes=2, master_port=port, distributed_timeout_s=1
    )
    args = WorkerArgs(config, 1, port, os.getpid(), logging.INFO)
    worker = [sys.executable, "-m", "deltaserve.engine.parallel.worker"]
    done = subprocess.run(worker, input=pickle.dumps(args), capture_output=True, timeout=120)
    err = done.stderr.decode()
    assert done.returncode == 1, err
    assert "rank 1 could not reach rank 0 in 1 s" in err and "--master-addr" in err, err
    assert "frame #" not in err and "Exception raised from" not in err and "Traceback" not in err, err


def test_mtp_speculation_at_tp2(qwen, tmp_path, pools_held):
    """Each rank holds its shard of the MTP layer and replays rank 0's MTP forwards (the fill and
    the chained drafts, with their logits' all-gather): TP = 2 proposes TP = 1's drafts, the
    tokens stay those without speculation, and the MTP layer's KV agrees across ranks."""
    from ..spec_decode.test_spec_mtp import with_mtp

    path = with_mtp(qwen, str(tmp_path / "mtp"))
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    prompts = prompts_of([5, 70, 33], seed=3)
    plain = tp1(qwen, prompts, 16)

    def drafted(llm: LLM) -> tuple[list[list[int]], list[tuple[tuple[int, ...], list[int]]]]:
        assert llm.engine.spec is not None and llm.engine.spec.mtp is not None
        take, proposed = llm.engine.spec.mtp.take, []

        def spy(req):
            drafts = take(req)
            proposed.append((tuple(req.all_token_ids), drafts))
            return drafts

        llm.engine.spec.mtp.take = spy  # type: ignore[method-assign]
        return run(llm, prompts, 16), proposed

    with make_llm(path, 1, speculative_config=spec) as llm:
        ref_tokens, ref_drafts = drafted(llm)
    with make_llm(path, 2, speculative_config=spec) as llm:
        tokens, drafts = drafted(llm)
        assert tokens == ref_tokens == plain
        assert sum(len(d) for _, d in drafts) > 0 and sorted(drafts) == sorted(ref_drafts)
        assert_ranks_agree(llm)
        assert not pools_held(llm)


@pytest.fixture(scope="module")
def qwen_moe(make_checkpoint) -> str:
    return make_checkpoint("qwen3_5_moe")


def test_expert_parallel_reaches_every_rank(qwen_moe, hf_reference):
    """LLM(enable_expert_parallel=True): rank 0 and its worker each hold 2 of the 4 experts whole
    (a worker holding width slices instead would sum other parts); greedy tokens equal TP=1's
    and transformers', again from the prefix cache."""
    prompts = prompts_of([5, 40, 17, 100], seed=9)
    ref = tp1(qwen_moe, prompts)
    assert ref == hf_reference(qwen_moe, prompts, 12)
    with make_llm(qwen_moe, 2, enable_expert_parallel=True) as llm:
        assert llm.engine.model_info["expert_parallel"] is True
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]
        assert experts and all(tuple(m.down_proj.shape) == (2, 32, 16) for m in experts)
        assert run(llm, prompts) == ref
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert sum(o.num_cached_tokens for o in outs) > 0
        assert_ranks_agree(llm)


def test_expert_parallel_at_one_rank_is_a_no_op(qwen_moe):
    """As in vLLM: with one rank the flag changes nothing (every expert, TP=1's tokens)."""
    prompts = prompts_of([9, 30], seed=10)
    with make_llm(qwen_moe, 1, enable_expert_parallel=True) as llm:
        assert llm.engine.model_info["expert_parallel"] is False
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]
        assert experts and all(m.down_proj.shape[0] == 4 for m in experts)
        assert run(llm, prompts) == tp1(qwen_moe, prompts)


@pytest.mark.parametrize(
    "sizes, tp, kw, says",
    [
        ({}, 3, {}, r"linear_num_key_heads \(2\) is not divisible by the tensor-parallel size 3"),
        (
            {"num_experts": 3},
            2,
            {"enable_expert_parallel": True},
            r"routed experts \(3\).*expert-parallel size 2",
        ),
    ],
)
def test_a_size_the_model_cannot_be_split_by_is_refused_before_any_rank_starts(
    make_checkpoint, monkeypatch, sizes: dict, tp: int, kw: dict, says: str
) -> None:
    """The ranks' own error, from config.json before any worker is spawned."""
    from deltaserve.engine.parallel import ranks

    def started(*_args, **_kw):
        raise AssertionError("a tensor-parallel rank was started")

    monkeypatch.setattr(ranks, "Ranks", started)
    with pytest.raises(ValueError, match=says):
        make_llm(make_checkpoint("qwen3_next", **sizes), tp, **kw)


def test_a_rank_that_cannot_load_logs_one_line(monkeypatch, caplog, tmp_path) -> None:
    """A worker rank whose shard fails to load says why in one line (rank 0 reports the model's
    error as its one-line start-up failure too); the traceback is for debug logs."""
    import io
    import logging
    import pickle
    import sys
    from types import SimpleNamespace

    from deltaserve.engine import parts
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.parallel import group, liveness, worker

    def refuse(*_):
        raise ValueError("linear_num_key_heads (2) is not divisible by the tensor-parallel size 3")

    monkeypatch.setattr(group, "rank_device", lambda *_: torch.device("cpu"))
    monkeypatch.setattr(group, "init_rank", lambda *_: SimpleNamespace(tp=None))
    monkeypatch.setattr(group, "destroy", lambda *_: None)
    monkeypatch.setattr(parts, "load_engine_model", refuse)
    monkeypatch.setattr(worker, "_exit_with", lambda *_: None)
    monkeypatch.setattr(liveness, "RankZeroWatch", lambda *_: SimpleNamespace(stop=lambda: None))
    monkeypatch.setattr(worker.signal, "signal", lambda *_: None)  # the test's own Ctrl-C stays
    monkeypatch.setattr(logging, "basicConfig", lambda **_: None)
    args = worker.WorkerArgs(EngineConfig(model=str(tmp_path), device="cpu"), 1, 0, os.getpid(), logging.INFO)
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(pickle.dumps(args))))
    with caplog.at_level(logging.INFO, logger="deltaserve"), pytest.raises(SystemExit):
        worker.main()
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == (
        "tensor-parallel rank 1 could not load the model: ValueError: linear_num_key_heads (2) is not "
        "divisible by the tensor-parallel size 3"
    )
    assert record.exc_info is None


# node 0 of two loopback nodes, rank 0 alone, as an offline LLM that sends its worker nothing once loaded
RANK_0 = """
import sys, time
from deltaserve import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, nnodes=2, master_port=int(sys.argv[2]), **eval(sys.argv[3]))
print("ready", flush=True)  # held: an LLM dropped is collected and stops its ranks
time.sleep(600)
"""
# node 1's rank, as the launcher starts it, with a shorter liveness timeout
WORKER = (
    "from deltaserve.engine.parallel import liveness; liveness.TIMEOUT_S = {timeout}; "
    "from deltaserve.engine.parallel.worker import main; main()"
)
NODE_KW = dict(
    dtype="float32", device="cpu", page_size=16, max_num_batched_tokens=32, num_kv_pages=160,
    max_model_len=512, max_running_requests=8,
)  # fmt: skip


@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_a_worker_exits_in_one_line_once_rank_0_is_gone_or_silent(qwen, tmp_path, sig, master_port):
    """Node 1's rank outlives an idle rank 0 that sends it nothing for longer than the liveness
    timeout (rank 0's store answers it), and exits with one error line once rank 0 is killed (its
    connection closes) or stopped, as a hung rank 0 or a node 0 that vanished is (its store stops
    answering): it used to wait for rank 0's next message for ever, or die with a traceback."""
    import logging
    import pickle
    import signal
    import subprocess
    import sys

    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.parallel.worker import WorkerArgs

    timeout, port = 3.0, master_port
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK_0, qwen, str(port), repr(NODE_KW)],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "rank0.log", "w"),
        text=True,
    )
    config = EngineConfig(
        model=qwen, tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=port, **NODE_KW
    )
    err = open(tmp_path / "worker.log", "w+")
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER.format(timeout=timeout)], stdin=subprocess.PIPE, stderr=err
    )
    assert worker.stdin is not None and rank0.stdout is not None
    worker.stdin.write(pickle.dumps(WorkerArgs(config, 1, port, os.getpid(), logging.INFO)))
    worker.stdin.close()
    try:
        assert rank0.stdout.readline() == "ready\n", (tmp_path / "rank0.log").read_text()[-3000:]
        time.sleep(timeout + 2)  # rank 0 idles, sending nothing: its worker waits on
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
        t0 = time.monotonic()
        os.kill(rank0.pid, getattr(signal, sig))
        assert worker.wait(timeout + 20) == 1
        assert time.monotonic() - t0 < timeout + 10
    finally:
        for proc in (worker, rank0):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = (tmp_path / "worker.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    (line,) = [x for x in log.splitlines() if " ERROR " in x]
    why = "rank 0 is gone (Connection closed by peer" if sig == "SIGKILL" else "did not answer for 3 s"
    assert "tensor-parallel rank 1 is exiting: " in line and why in line, line


def test_a_worker_stopped_in_a_step_ends_the_engine(qwen, monkeypatch):
    """A worker that stops (SIGSTOP, as a frozen process or an unreachable node) while rank 0's
    step waits on it inside a collective: its counter on the rendezvous store stands still, so the
    engine is dead after the liveness timeout, naming the rank, and the worker (one of this node's)
    is killed so that the step fails. The step used to wait for ever. An idle worker, whose
    counter runs on, changes nothing."""
    import signal
    import threading

    from deltaserve.engine.parallel import liveness

    monkeypatch.setattr(liveness, "TIMEOUT_S", 3.0)
    llm = make_llm(qwen, 2)
    workers = llm.engine.ranks.workers
    assert workers is not None
    (worker,) = workers.pids
    try:
        time.sleep(5)  # idle past the timeout: nothing is sent, the worker's counter runs on
        assert llm.engine.dead_reason is None
        os.kill(worker, signal.SIGSTOP)
        failed: list[BaseException] = []

        def step() -> None:
            try:
                run(llm, prompts_of([5], seed=2))
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=step, daemon=True)
        t0 = time.monotonic()
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "the step still waits on the stopped worker"
        assert time.monotonic() - t0 < 15
        (exc,) = failed
        assert isinstance(exc, EngineDeadError), exc
        assert "tensor-parallel rank 1 was not heard from for 3 s" in str(exc), exc
        # its socket closes (failing the step) before the kernel has finished tearing it down
        gone = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < gone:
            time.sleep(0.05)
        assert not _alive(worker)
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
        llm.shutdown()
