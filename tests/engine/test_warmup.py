"""The start-up warm-up runs prompts through mixed steps and leaves the engine as new."""

from __future__ import annotations

from typing import Any

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams


def make(path: str, warmup: bool, cache_type: str = "radix", **config: Any) -> Engine:
    return Engine(
        EngineConfig(
            model=path,
            dtype="float32",
            device="cpu",
            chunked_prefill_size=32,
            max_running_requests=4,
            max_model_len=256,
            cache_type=cache_type,
            warmup=warmup,
            **config,
        )
    )


def greedy(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return out


@pytest.mark.parametrize("cache_type", ["radix", "naive"])
@pytest.mark.slow
def test_warmed_engine_is_as_new(make_checkpoint, cache_type: str) -> None:
    path = make_checkpoint("qwen3_next")
    warm, cold = make(path, True, cache_type), make(path, False, cache_type)
    stats, fresh = warm.stats(), cold.stats()
    # nothing of the warm-up stays: no cached page or snapshot, counters and hit statistics at zero
    assert stats == fresh
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0
    assert warm.runner.kv_pool.num_used == 0 and warm.runner.state_pool.num_snapshots_used == 0
    assert not warm.requests
    prompts = [[(5 * i + j) % 150 + 1 for j in range(n)] for i, n in enumerate((40, 7, 70))]
    assert greedy(warm, prompts) == greedy(cold, prompts)
    times = ("step_seconds_total", "gpu_wait_seconds_total")  # wall time: never equal twice
    assert {k: v for k, v in warm.stats().items() if k not in times} == {
        k: v for k, v in cold.stats().items() if k not in times
    }


def test_warmup_follows_the_device() -> None:
    cfg = EngineConfig(model="unused", device="cpu")
    assert cfg.warmup is False


@pytest.mark.slow
def test_where_kernels_compile_the_warm_up_runs_a_prefill_step_of_each_size(
    make_checkpoint, monkeypatch
) -> None:
    """On CUDA (here: told the fast kernels run) the mixed steps are followed by one prefill step
    of each power of two of tokens, as far as prompts of a chunk (32) on the running requests (4)
    reach: 256 tokens would take 8. The radix cache, which ends a prompt's chunk early, sits them
    out, and the engine is as new after them."""
    from deltaserve.engine import engine as engine_module

    path = make_checkpoint("qwen3_next")
    warm, cold = make(path, False, "radix"), make(path, False, "radix")
    monkeypatch.setattr(engine_module, "use_fast_path", lambda t: True)
    tokens: list[int] = []
    forward = warm.runner.forward

    def counted(batch):  # type: ignore[no-untyped-def]
        tokens.append(batch.input_ids.shape[0])
        return forward(batch)

    monkeypatch.setattr(warm.runner, "forward", counted)
    warm._warm_up()
    assert tokens[-8:] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert warm.stats() == cold.stats()
    assert warm.runner.kv_pool.num_used == 0 and warm.runner.state_pool.num_snapshots_used == 0
    assert warm.config.cache_type == "radix" and type(warm.prefix_cache) is type(cold.prefix_cache)
    prompts = [[(5 * i + j) % 150 + 1 for j in range(n)] for i, n in enumerate((40, 7, 70))]
    assert greedy(warm, prompts) == greedy(cold, prompts)


def warm_up_decode_steps(engine: Engine, monkeypatch) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    """Runs the engine's warm-up; (rows, longest context) of each of its decode-only steps."""
    decodes: list[tuple[int, int]] = []
    forward = engine.runner.forward

    def counted(batch):  # type: ignore[no-untyped-def]
        if batch.num_decodes == batch.num_requests:
            decodes.append((batch.num_decodes, int(batch.seq_lens.max())))
        return forward(batch)

    monkeypatch.setattr(engine.runner, "forward", counted)
    engine._warm_up()
    return decodes


@pytest.mark.slow
def test_eager_decode_warm_up_runs_a_decode_step_of_each_row_count(make_checkpoint, monkeypatch) -> None:
    """Where decode steps run eagerly (no CUDA graphs) and kernels compile, the warm-up runs a
    decode step of 1, 2, 3 and 4 rows (the running requests), one of them `min(4096, half the
    model's length)` tokens into its context, before the prefill steps; the engine is as new
    after them."""
    from deltaserve.engine import engine as engine_module

    path = make_checkpoint("qwen3_next")
    warm, cold = make(path, False, "radix"), make(path, False, "radix")
    assert warm.runner.graph_runner is None
    monkeypatch.setattr(engine_module, "use_fast_path", lambda t: True)
    decodes = warm_up_decode_steps(warm, monkeypatch)
    full = [(n, context) for n, context in decodes if context > 128]
    assert sorted({n for n, _ in full}) == [1, 2, 3, 4]
    assert warm.stats() == cold.stats()
    assert warm.runner.kv_pool.num_used == 0 and warm.runner.state_pool.num_snapshots_used == 0
    assert not warm.requests and not warm._finished_outputs
    assert warm.config.cache_type == "radix" and type(warm.prefix_cache) is type(cold.prefix_cache)
    prompts = [[(5 * i + j) % 150 + 1 for j in range(n)] for i, n in enumerate((40, 7, 70))]
    assert greedy(warm, prompts) == greedy(cold, prompts)


@pytest.mark.slow
def test_eager_decode_warm_up_leaves_out_what_the_pools_cannot_hold(make_checkpoint, monkeypatch) -> None:
    """KV pages for the long request (64 tokens) and a few more of 8 tokens, not for 8 requests:
    the warm-up leaves the larger counts out (it did not wait for a request to end, 64 tokens
    later) and the engine is as new."""
    from deltaserve.engine import engine as engine_module

    path = make_checkpoint("qwen3_next")
    config = EngineConfig(
        model=path,
        dtype="float32",
        device="cpu",
        chunked_prefill_size=32,
        max_running_requests=8,
        max_model_len=128,
        page_size=4,
        num_kv_pages=33,
        warmup=False,
    )
    warm = Engine(config)
    monkeypatch.setattr(engine_module, "use_fast_path", lambda t: True)
    rows = list(range(1, 9))
    ran, widths = warm._warm_up_decode_rows(rows)
    assert ran == rows[: len(ran)] and 1 < len(ran) < len(rows) and widths == [], ran
    assert not warm.requests and not warm.has_unfinished_requests()
    assert warm.runner.kv_pool.num_used == 0


def assert_as_new(warm: Engine, cold: Engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The warmed engine's statistics, pools and requests are a cold one's, and (without the stub
    graphs) it generates what the cold one does."""
    assert warm.stats() == cold.stats()
    assert warm.runner.kv_pool.num_used == 0 and warm.runner.state_pool.num_snapshots_used == 0
    assert not warm.requests and not warm._finished_outputs
    monkeypatch.setattr(warm.runner, "graph_runner", None)
    prompts = [[(5 * i + j) % 150 + 1 for j in range(n)] for i, n in enumerate((40, 7, 70))]
    assert greedy(warm, prompts) == greedy(cold, prompts)


class NoGraphs:
    """Decode graphs captured, as the engine sees it (`graph_runner` is set); none replays here."""

    sizes = [4]  # the rows of each graph: here every count of running requests

    def can_run(self, batch) -> bool:  # type: ignore[no-untyped-def]
        return False

    def can_run_verify(self, batch) -> bool:  # type: ignore[no-untyped-def]
        return False


@pytest.mark.slow
@pytest.mark.parametrize("method, graphs", [("ngram", False), ("ngram", True), ("mtp", False)])
def test_speculative_warm_up_runs_decode_rows_and_a_window_of_each_width(
    make_checkpoint, tmp_path, monkeypatch, method, graphs
) -> None:
    """With speculative decoding (k = 3) the warm-up's decode steps stay decode steps of 1 to 4
    rows, whatever the drafter proposes (MTP drafts for every request; n-gram as outputs repeat),
    or of 1, 3 and 4 where decode graphs were captured; then the first request verifies a window
    of 2, 3 and 4 tokens beside the other three's decode rows. The engine is as new after them
    and speculates as one that never warmed up."""
    from deltaserve.engine import engine as engine_module
    from tests.engine.spec_decode.test_spec_mtp import with_mtp

    path = make_checkpoint("qwen3_next")
    if method == "mtp":
        path = with_mtp(path, str(tmp_path / "mtp"))

    spec = {"method": method, "num_speculative_tokens": 3}
    warm, cold = make(path, False, speculative_config=spec), make(path, False, speculative_config=spec)
    if graphs:
        monkeypatch.setattr(warm.runner, "graph_runner", NoGraphs())
    monkeypatch.setattr(engine_module, "use_fast_path", lambda t: True)
    steps: list[tuple[int, tuple[int, ...], int]] = []  # (decode rows, windows, prompts) beside the long one
    forward = warm.runner.forward

    def counted(batch):  # type: ignore[no-untyped-def]
        if int(batch.seq_lens.max()) > 128:
            rest = batch.num_requests - batch.num_decodes - len(batch.verify_lens)
            steps.append((batch.num_decodes, tuple(batch.verify_lens), rest))
        return forward(batch)

    monkeypatch.setattr(warm.runner, "forward", counted)
    warm._warm_up()
    decodes = sorted({d for d, windows, rest in steps if not windows and not rest})
    assert decodes == ([1, 3, 4] if graphs else [1, 2, 3, 4]), steps
    assert [(d, windows) for d, windows, _ in steps if windows] == [(3, (2,)), (3, (3,)), (3, (4,))], steps
    assert warm.stats() == cold.stats()
    assert warm.runner.kv_pool.num_used == 0 and warm.runner.state_pool.num_snapshots_used == 0
    assert not warm.requests and not warm._finished_outputs
    assert warm.scheduler.propose is not None and warm.config.cache_type == cold.config.cache_type
    prompts = [[(5 * i + j) % 150 + 1 for j in range(n)] for i, n in enumerate((40, 7, 70))]
    monkeypatch.setattr(warm.runner, "graph_runner", None)
    assert greedy(warm, prompts) == greedy(cold, prompts)
    times = ("step_seconds_total", "gpu_wait_seconds_total")
    assert {k: v for k, v in warm.stats().items() if k not in times} == {
        k: v for k, v in cold.stats().items() if k not in times
    }


@pytest.mark.slow
def test_with_decode_graphs_the_warm_up_runs_prompts_beside_decode_rows(make_checkpoint, monkeypatch) -> None:
    """Where decode graphs were captured (here a stub that replays nothing) the warm-up's decode
    steps are of 1, 3 and 4 rows: prompts join beside one decode row and beside three, the eager
    decode rows of a step with prompts at both ends of the running batch; the engine is as new
    after them."""
    from deltaserve.engine import engine as engine_module

    path = make_checkpoint("qwen3_next")
    warm, cold = make(path, False, "radix"), make(path, False, "radix")
    monkeypatch.setattr(warm.runner, "graph_runner", NoGraphs())
    monkeypatch.setattr(engine_module, "use_fast_path", lambda t: True)
    steps: list[tuple[int, int]] = []  # (decode rows, prompts) of steps beside the long request
    forward = warm.runner.forward

    def counted(batch):  # type: ignore[no-untyped-def]
        if int(batch.seq_lens.max()) > 128:
            steps.append((batch.num_decodes, batch.num_requests - batch.num_decodes))
        return forward(batch)

    monkeypatch.setattr(warm.runner, "forward", counted)
    warm._warm_up()
    assert sorted({d for d, prompts in steps if not prompts}) == [1, 3, 4], steps
    assert (1, 2) in steps and (3, 1) in steps, steps
    assert_as_new(warm, cold, monkeypatch)


class OneRowGraphs(NoGraphs):
    sizes = [1]  # --cuda-graph-max-bs 1: steps of more decode rows run eagerly


@pytest.mark.slow
def test_with_decode_graphs_below_the_running_requests_the_warm_up_runs_decode_steps_past_them(
    make_checkpoint, monkeypatch
) -> None:
    """Decode graphs of one row below 4 running requests: past them the warm-up runs decode steps
    of 2 (the fewest rows that run eagerly), 3 and 4 rows beside its long request, then one of 2
    rows whose contexts are all short (8-token prompts), for paged decode's tiles at both; the
    engine is as new after them."""
    from deltaserve.engine import engine as engine_module

    path = make_checkpoint("qwen3_next")
    warm, cold = make(path, False, "radix"), make(path, False, "radix")
    monkeypatch.setattr(warm.runner, "graph_runner", OneRowGraphs())
    monkeypatch.setattr(engine_module, "use_fast_path", lambda t: True)
    decodes = warm_up_decode_steps(warm, monkeypatch)
    assert sorted({n for n, context in decodes if context > 128}) == [1, 2, 3, 4], decodes
    assert [n for n, context in decodes if context <= 9] == [2], decodes
    assert_as_new(warm, cold, monkeypatch)
