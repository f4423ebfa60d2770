"""The radix prefix cache inside the engine: greedy outputs equal `cache_type="naive"`, later
requests report cached tokens, and every page and slot comes back once the cache is flushed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.cache.cache_policy import POLICIES
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.outputs import RequestOutput

# Many engine runs each held to a cache-less one (tests/engine/cache/test_radix_cache.py stays fast)
pytestmark = pytest.mark.slow

VOCAB = 160
PAGE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def rand(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def path(remembering_checkpoint) -> str:
    return remembering_checkpoint("qwen3_next")


def make_llm(path: str, cache_type: str = "radix", chunk: int = 64, **kwargs) -> LLM:
    kwargs.setdefault("max_running_requests", 4)
    return LLM(
        path, dtype="float32", device="cpu", chunked_prefill_size=chunk, cache_type=cache_type, **kwargs
    )


def run(llm: LLM, batches: list[list[list[int]]], params: SamplingParams = GREEDY) -> list[RequestOutput]:
    """Each batch is one `generate` call (its prompts run concurrently), after the previous one."""
    outs: list[RequestOutput] = []
    for batch in batches:
        outs += llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return outs


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_idle_after_flush(engine: Engine) -> None:
    s = engine.stats()
    assert (s["running"], s["waiting"], s["kv_pages_used"], s["state_slots_used"]) == (0, 0, 0, 0), s
    engine.flush_cache()
    s = engine.stats()
    kv, st = engine.runner.kv_pool, engine.runner.state_pool
    assert (kv.num_used, st.num_used, st.num_snapshots_used) == (0, 0, 0), s
    assert (s["kv_pages_cached"], s["snapshots"], s["snapshot_bytes"]) == (0, 0, 0), s
    assert sorted(kv._free) == list(range(1, kv.num_pages)), "a page leaked or was freed twice"


def shared_prefix(n: int = 10) -> list[list[list[int]]]:
    """One user first, then the rest in small concurrent groups, all behind one 256-token prefix."""
    prefix = rand(256, 1)
    prompts = [prefix + rand(1 + 13 * i % 70, 100 + i) for i in range(n)]
    return [prompts[:1], prompts[1:2]] + [prompts[i : i + 3] for i in range(2, n, 3)]


def multi_turn(llm: LLM, num_chats: int = 3, num_turns: int = 4) -> list[list[RequestOutput]]:
    """Turn k+1's prompt is turn k's prompt, its output and a new user message; the chats'
    turns run concurrently."""
    prompts = [rand(40 + 25 * c, 200 + c) for c in range(num_chats)]
    turns = []
    for t in range(num_turns):
        outs = run(llm, [prompts])
        turns.append(outs)
        prompts = [
            p + o.outputs[0].token_ids + rand(5 + 9 * t, 300 + 10 * t + c)
            for c, (p, o) in enumerate(zip(prompts, outs))
        ]
    return turns


@pytest.mark.parametrize("chunk", [32, 64])
def test_shared_prefix_matches_naive_and_hits(path, chunk):
    batches = shared_prefix()
    want = tokens(run(make_llm(path, "naive", chunk), batches))
    llm = make_llm(path, chunk=chunk)
    outs = run(llm, batches)
    assert tokens(outs) == want
    cached = [o.num_cached_tokens for o in outs]
    # The first request (257 tokens, 8 out) leaves its end snapshot at 256: the rest start there.
    assert cached[0] == 0 and all(c == 256 for c in cached[1:]), cached
    s = llm.engine.stats()
    assert s["cached_tokens_total"] == sum(cached) == s["prefix_cache_hit_tokens"]
    assert s["prefix_cache_query_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert_idle_after_flush(llm.engine)


def test_multi_turn_matches_naive_and_every_later_turn_hits(path):
    want = [tokens(t) for t in multi_turn(make_llm(path, "naive"))]
    llm = make_llm(path)
    turns = multi_turn(llm)
    assert [tokens(t) for t in turns] == want
    for before, after in zip(turns, turns[1:]):
        for prev, o in zip(before, after):
            # the previous turn's end snapshot: its computed tokens (all but the last output) in whole pages
            computed = len(prev.prompt_token_ids) + len(prev.outputs[0].token_ids) - 1
            assert o.num_cached_tokens == computed // PAGE * PAGE > 0
    assert_idle_after_flush(llm.engine)


@pytest.mark.parametrize("chunk", [32, 64])
def test_hit_at_every_chunk_alignment(path, chunk):
    """every_chunk_lru snapshots each chunk end of a long prompt: a prompt that leaves it
    at any chunk boundary starts there."""
    base = rand(256, 5)
    batches = [[base]] + [[base[:k] + rand(20, k)] for k in range(chunk, 256, chunk)]
    want = tokens(run(make_llm(path, "naive", chunk), batches))
    llm = make_llm(path, chunk=chunk, prefix_cache_policy="every_chunk_lru", num_snapshot_slots=32)
    outs = run(llm, batches)
    assert tokens(outs) == want
    assert [o.num_cached_tokens for o in outs] == [0] + list(range(chunk, 256, chunk))
    assert_idle_after_flush(llm.engine)


def test_hit_exactly_at_a_branch_point(path):
    """The first prompt to leave the tree mid-edge starts at the last chunk boundary before it
    (a tentative snapshot), splits its prefill at the (page-aligned) branch point and leaves a
    snapshot there; the next one to branch there starts at it."""
    base = rand(200, 6)
    batches = [[base], [base[:100] + rand(30, 1)], [base[:100] + rand(50, 2)], [base[:96] + rand(9, 3)]]
    want = tokens(run(make_llm(path, "naive"), batches))
    llm = make_llm(path)
    outs = run(llm, batches)
    assert tokens(outs) == want
    assert [o.num_cached_tokens for o in outs] == [0, 64, 96, 96]
    assert llm.engine.stats()["snapshots"] >= 1
    assert_idle_after_flush(llm.engine)


def test_prompt_that_is_a_prefix_of_a_cached_one(path):
    base = rand(200, 7)
    # The first one starts at a chunk boundary of the first's prefill (tentative), the second
    # at its own prompt end; base[:160] ends on a page: its last token is still recomputed.
    batches = [[base], [base[:150]], [base[:150]], [base[:160]], [base[:145]], [base]]
    want = tokens(run(make_llm(path, "naive"), batches))
    llm = make_llm(path)
    outs = run(llm, batches)
    assert tokens(outs) == want
    cached = [o.num_cached_tokens for o in outs]
    assert cached == [0, 128, 144, 144, 144, 192], cached  # the last: the first one's prompt end
    assert_idle_after_flush(llm.engine)


def test_prompts_arriving_together_compute_their_shared_prefix_once(path):
    """Prompts of one step behind one prefix (a resent prompt; a system prompt, which the server
    names in `shared_prefix_len`): those behind the first wait a step for the state its chunk
    keeps, and start there. Before, each computed the prefix beside the others while the step's
    budget lasted (here all of them)."""
    same = rand(150, 11)
    head = rand(140, 12)
    chats = [head + rand(10 + i, 20 + i) for i in range(3)]
    behind_head = replace(GREEDY, shared_prefix_len=len(head))
    want = tokens(run(make_llm(path, "naive", 512), [[same] * 3, chats]))
    llm = make_llm(path, chunk=512)
    outs = run(llm, [[same] * 3]) + run(llm, [chats], behind_head)
    assert tokens(outs) == want
    resend = (len(same) - 1) // PAGE * PAGE  # the deepest state a resend starts from
    assert [o.num_cached_tokens for o in outs] == [0, resend, resend, 0] + [len(head) // PAGE * PAGE] * 2
    assert_idle_after_flush(llm.engine)


def test_a_prompt_asking_for_its_logprobs_does_not_wait_for_a_shared_prefix(path):
    """The cache never serves a prompt whose logprobs are asked for: it runs beside the first."""
    prompt = rand(150, 13)
    engine = make_llm(path, chunk=512).engine
    engine.add_request("first", prompt, GREEDY)
    engine.add_request("scored", prompt, replace(GREEDY, prompt_logprobs=0))
    engine.step()
    assert engine.stats()["running"] == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle_after_flush(engine)


def test_small_pools_evict_and_still_match(path):
    """Three snapshot slots and room for about two requests' KV: snapshots and cached pages
    are evicted (and decodes preempted) all along, and outputs stay exact."""
    batches = shared_prefix(8)
    kwargs = dict(max_running_requests=3, num_kv_pages=48, num_snapshot_slots=3)
    want = tokens(run(make_llm(path, "naive", **kwargs), batches))
    llm = make_llm(path, **kwargs)
    outs = run(llm, batches)
    turns = multi_turn(llm, num_chats=3, num_turns=3)
    assert tokens(outs) == want
    ref = make_llm(path, "naive", **kwargs)
    assert [tokens(t) for t in turns] == [tokens(t) for t in multi_turn(ref, num_chats=3, num_turns=3)]
    s = llm.engine.stats()
    assert s["snapshot_evictions"] > 0 and s["kv_page_evictions"] > 0, s
    assert s["cached_tokens_total"] > 0, s
    assert_idle_after_flush(llm.engine)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_same_outputs(path, policy):
    batches = shared_prefix(6)
    want = tokens(run(make_llm(path, "naive", 32), batches))
    llm = make_llm(path, chunk=32, prefix_cache_policy=policy, num_snapshot_slots=6)
    assert tokens(run(llm, batches)) == want
    assert llm.engine.stats()["cached_tokens_total"] > 0
    assert_idle_after_flush(llm.engine)


def test_abort_inserts_what_was_computed(path):
    """An aborted request's computed pages stay cached; a later run of its prompt hits them."""
    prompt = rand(300, 8)
    llm = make_llm(path)
    engine = llm.engine
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    # 4 prefill chunks of 64, one to the resend point 288, one to 300, then 4 decodes: 304 computed
    for _ in range(10):
        engine.step()
    engine.abort_request("a")
    [aborted] = engine.step()
    assert aborted.outputs[0].finish_reason == "abort"
    follow_up = prompt + aborted.outputs[0].token_ids + rand(10, 9)
    [out] = run(llm, [[follow_up]])
    assert out.num_cached_tokens == 304  # the state copied as decoding crossed 304
    assert tokens([out]) == tokens(run(make_llm(path, "naive"), [[follow_up]]))
    assert_idle_after_flush(engine)


def test_naive_reuses_nothing(path):
    llm = make_llm(path, "naive")
    outs = run(llm, shared_prefix(4))
    assert all(o.num_cached_tokens == 0 for o in outs)
    s = llm.engine.stats()
    assert (s["snapshots_total"], s["prefix_cache_hit_tokens"], s["kv_pages_cached"]) == (0, 0, 0)


def test_preemption_releases_and_recomputes_from_the_cache(path, monkeypatch):
    """Too few pages for four long decodes behind a cached prefix: decodes preempt each other,
    hand their computed pages to the tree, and start again from there."""
    from deltaserve.engine.step.scheduler import Scheduler

    preempted = []
    preempt = Scheduler.preempt
    monkeypatch.setattr(Scheduler, "preempt", lambda self, req: (preempted.append(req), preempt(self, req)))
    prefix = rand(64, 10)
    # The second warm-up request leaves the tree at 64: a branch snapshot there.
    batches = [[prefix + rand(3, 11)], [prefix + rand(3, 12)], [prefix + rand(20, 13 + i) for i in range(4)]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kwargs = dict(max_running_requests=4, num_kv_pages=14)
    want = tokens(run(make_llm(path, "naive", **kwargs), batches, params))
    llm = make_llm(path, **kwargs)
    outs = run(llm, batches, params)
    assert tokens(outs) == want
    assert preempted and [o.num_cached_tokens for o in outs[2:]] == [64] * 4
    assert_idle_after_flush(llm.engine)


# Where users repeat themselves: resends, chat follow-ups, first branches off a shared prompt.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
LONGER = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # decoding crosses a page


def repeating(n: int, seed: int) -> list[int]:
    """A prompt that repeats itself, so that n-gram drafts are proposed and verified."""
    return (rand(50, seed) * (n // 50 + 1))[:n]


def check_spec_ran(llm: LLM, spec: dict | None) -> None:
    if spec is not None:
        assert llm.engine.stats()["spec_draft_tokens_total"] > 0, "no draft was verified"


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_exact_resend_hits_all_but_the_last_page(path, spec):
    """One chunk per prompt: the prefill stops at the last page boundary before the last token,
    whose state is kept. A resend restores it mid-page (200 tokens: 192, then 8 recomputed) or
    a page before the end (208: the prompt end's own state cannot serve, its last token must be
    recomputed)."""
    a, b = repeating(200, 20), repeating(208, 21)
    batches = [[a], [a], [b], [b]]
    want = tokens(run(make_llm(path, "naive", 512), batches, LONGER))
    llm = make_llm(path, chunk=512, speculative_config=spec)
    outs = run(llm, batches, LONGER)
    assert tokens(outs) == want
    assert [o.num_cached_tokens for o in outs] == [0, 192, 0, 192]
    check_spec_ran(llm, spec)
    assert_idle_after_flush(llm.engine)


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_chat_turn_two_hits_the_whole_previous_prompt(path, spec):
    """Turn 2 carries turn 1's answer re-rendered into other tokens than were generated: it
    starts from turn 1's prompt end, every full page of turn 1's prompt."""
    firsts = [repeating(200, 30), repeating(208, 31)]
    batches = [[firsts[0]], [firsts[1]], [firsts[0] + rand(40, 32)], [firsts[1] + rand(40, 33)]]
    want = tokens(run(make_llm(path, "naive", 512), batches, LONGER))
    llm = make_llm(path, chunk=512, speculative_config=spec)
    outs = run(llm, batches, LONGER)
    assert tokens(outs) == want
    assert [o.num_cached_tokens for o in outs] == [0, 0, 192, 208]
    check_spec_ran(llm, spec)
    assert_idle_after_flush(llm.engine)


def test_chat_turn_two_hits_where_its_history_leaves_the_generation_prompt(path):
    """A chat prompt whose generation prompt ends in tokens that the next turn does not repeat
    (Qwen3.5's `<think>\\n`; `enable_thinking` false: an empty reasoning block): the prompt end's
    state is kept within what the next turn repeats (`next_turn_len`). 210 tokens, the last 4
    not repeated: turn 2 starts at 192 (the page boundary at 208 is past where it leaves), where
    nothing was kept without the hint; a resend still hits 208."""
    first = repeating(210, 50)
    params = [replace(LONGER, next_turn_len=206), LONGER]
    batches = [[first], [first[:206] + rand(40, 51)], [first]]
    want = tokens(run(make_llm(path, "naive", 512), batches, LONGER))
    llm = make_llm(path, chunk=512)
    outs = [
        llm.generate([{"prompt_token_ids": b[0]}], params[i == 1], use_tqdm=False)[0]
        for i, b in enumerate(batches)
    ]
    assert tokens(outs) == want
    assert [o.num_cached_tokens for o in outs] == [0, 192, 208]
    assert_idle_after_flush(llm.engine)


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_first_branch_off_a_shared_system_prompt_hits(path, spec):
    """64-token chunks: the first request keeps its last chunk boundaries' states as tentative
    snapshots, so the first request to branch off its system prompt starts at the last chunk
    boundary before the branch (256 tokens: at 256; 250 tokens: at 192), and the branch point
    it leaves serves the ones after it."""
    sys_a, sys_b = repeating(256, 40), repeating(250, 41)
    batches = [[sys_a + rand(30, 42)], [sys_a + rand(20, 43)], [sys_a + rand(25, 44)]]
    batches += [[sys_b + rand(30, 45)], [sys_b + rand(20, 46)], [sys_b + rand(25, 47)]]
    want = tokens(run(make_llm(path, "naive"), batches, LONGER))
    llm = make_llm(path, speculative_config=spec)
    outs = run(llm, batches, LONGER)
    assert tokens(outs) == want
    assert [o.num_cached_tokens for o in outs] == [0, 256, 256, 0, 192, 240]
    s = llm.engine.stats()
    assert s["snapshots_total"] == 8 and s["snapshots_used"] <= 8  # two per running request
    check_spec_ran(llm, spec)
    assert_idle_after_flush(llm.engine)


@pytest.mark.parametrize("budget,chunk,page", [(15, 16, 16), (8, 100, 16), (16, 64, 32)])
def test_a_chunk_larger_than_the_step_budget_is_cut_to_it(path, budget, chunk, page) -> None:
    """A step budget below the chunk size, the chunks' alignment and the page size: prompts longer
    than the budget are prefilled in budget-sized chunks (they waited forever) and give the
    tokens of one-chunk prefills."""
    prompts = [rand(70, 7), rand(33, 8), rand(5, 9)]
    want = tokens(run(make_llm(path, "naive", chunk=128), [prompts]))
    llm = make_llm(path, chunk=chunk, max_num_batched_tokens=budget, page_size=page)
    assert llm.engine.config.chunk_size == budget
    assert tokens(run(llm, [prompts])) == want
    assert_idle_after_flush(llm.engine)


def test_cache_salt_hits_only_its_own_salts_prefixes(path):
    """vLLM's `cache_salt` (a prompt dict's key): a prompt hits only what prompts with the same
    salt cached, an unsalted one only unsalted entries; the outputs are the naive run's."""
    a = repeating(200, 22)
    salts = ["x", "y", "x", None, None, "y"]
    want = tokens(run(make_llm(path, "naive", 512), [[a]] * len(salts), LONGER))
    llm = make_llm(path, chunk=512)
    outs = []
    for salt in salts:
        prompt = {"prompt_token_ids": a} if salt is None else {"prompt_token_ids": a, "cache_salt": salt}
        outs += llm.generate([prompt], LONGER, use_tqdm=False)
    assert tokens(outs) == want
    assert [o.num_cached_tokens for o in outs] == [0, 0, 192, 0, 192, 192]
    assert_idle_after_flush(llm.engine)


def test_prompts_of_other_salts_do_not_wait_for_a_shared_prefix(path):
    """The same prompt arriving together under two salts: each computes its own, side by side
    (a prompt waits a step only for a prefix it may hit)."""
    prompt = rand(150, 14)
    engine = make_llm(path, chunk=512).engine
    engine.add_request("first", prompt, GREEDY)
    engine.add_request("salted", prompt, replace(GREEDY, cache_salt="x"))
    engine.step()
    assert engine.stats()["running"] == 2
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle_after_flush(engine)


def test_the_warm_up_of_n_salted_copies_is_salted_too(path):
    """n > 1 prefills the prompt once first, under its salt: the copies hit it, an unsalted
    prompt does not."""
    a = rand(150, 15)
    llm = make_llm(path, chunk=512)
    (salted,) = llm.generate(
        [{"prompt_token_ids": a, "cache_salt": "x"}],
        replace(GREEDY, n=2, temperature=1.0, top_k=1),
        use_tqdm=False,
    )
    (plain,) = llm.generate([{"prompt_token_ids": a}], GREEDY, use_tqdm=False)
    assert (salted.num_cached_tokens, plain.num_cached_tokens) == (144, 0)
    assert_idle_after_flush(llm.engine)
