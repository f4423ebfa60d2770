"""Speculative decoding through GDN and KDA layers: greedy outputs identical with and without
it, for every accepted count, with chunked prefill, mixed batches, the radix cache, stops
inside a window and aborts; the state committed after each window is plain decoding's."""

from __future__ import annotations

import json

import pytest
import torch

from deltaserve import LLM, SamplingParams

K = 3
NEW = 20
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}


@pytest.fixture(scope="module", params=["gdn", "kda"])
def model_path(request, remembering_checkpoint) -> str:
    # long-memory layers: a window's state committed a token off changes the greedy tokens
    return remembering_checkpoint("qwen3_5" if request.param == "gdn" else "kimi")


def prompts_of(lengths: list[int], seed: int, repeat: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 160, (n,), generator=g).tolist() * repeat for n in lengths]


def make_llm(path: str, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("chunked_prefill_size", 32)
    kw.setdefault("max_num_batched_tokens", 32)  # a step's budget: prefills span steps beside windows
    kw.setdefault("num_kv_pages", 160)  # small pools: each LLM here allocates its own
    kw.setdefault("max_model_len", 512)
    kw.setdefault("page_size", 16)
    return LLM(path, dtype="float32", device="cpu", speculative_config=spec, **kw)


def greedy(max_tokens: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


class ForcedDrafter:
    """Proposes the true greedy continuation for exactly `right` tokens, then a wrong one."""

    def __init__(self, sequences: list[list[int]], right: int, vocab: int = 160) -> None:
        self.sequences, self.right, self.vocab = sequences, right, vocab
        self.expected_accepted = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        seq = next((s for s in self.sequences if s[: len(tokens)] == tokens), None)
        if seq is None:  # the output left every expected sequence: the test's comparison tells
            return []
        cont = seq[len(tokens) :]
        drafts = cont[: min(self.right, k)]
        if len(drafts) < k and len(cont) > len(drafts):
            drafts.append((cont[len(drafts)] + 1) % self.vocab)
        self.expected_accepted += min(self.right, len(drafts))
        return drafts


# one plain reference per (path, prompts): greedy decoding without speculation
_REFS: dict[tuple, list[list[int]]] = {}


def reference(path: str, prompts: list[list[int]], max_tokens: int = NEW) -> list[list[int]]:
    key = (path, tuple(map(tuple, prompts)), max_tokens)
    if key not in _REFS:
        _REFS[key] = run(make_llm(path, max_running_requests=8), prompts, greedy(max_tokens))
    return _REFS[key]


# prompts crossing 32-token chunk boundaries, a page-aligned one, short ones
LENGTHS = [5, 33, 70, 16, 100]


def test_every_accepted_count_matches_plain_decoding(model_path, pools_held):
    prompts = prompts_of(LENGTHS, seed=1)
    ref = reference(model_path, prompts)
    llm = make_llm(model_path, NGRAM, max_running_requests=8)
    for right in range(K + 1):
        drafter = ForcedDrafter([p + r for p, r in zip(prompts, ref)], right)
        llm.engine.spec.drafter = drafter
        before = llm.engine.stats()
        assert run(llm, prompts, greedy()) == ref, f"{right} right drafts"
        s = llm.engine.stats()
        accepted = s["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
        drafted = s["spec_draft_tokens_total"] - before["spec_draft_tokens_total"]
        assert accepted == drafter.expected_accepted and drafted > 0
        if right == 0:
            assert accepted == 0
        if right == K:
            assert accepted == drafted
    # the second and later passes hit the radix cache (snapshots saved from committed states)
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0
    assert not pools_held(llm)


def test_committed_state_equals_plain_decoding(model_path):
    """After each window, the working slot holds exactly the state plain decoding reaches
    after the same number of tokens; so does the prefix cache's rolling snapshot at a page
    boundary crossed inside a window."""
    prompt = prompts_of([37], seed=2)[0]
    ref = reference(model_path, [prompt])[0]

    def states_by_length(llm: LLM) -> tuple[dict[int, dict], dict[int, dict]]:
        eng = llm.engine
        eng.add_request("r", prompt, greedy())
        found: dict[int, dict[str, torch.Tensor]] = {}
        rolling: dict[int, dict[str, torch.Tensor]] = {}
        buffers = eng.runner.state_pool.buffers
        while eng.has_unfinished_requests():
            eng.step()
            req = eng.requests.get("r")
            if req is None or req.slot is None:
                continue
            found[req.num_computed_tokens] = {n: b[:, req.slot].clone() for n, b in buffers.items()}
            hold = req.prefix
            if hold is not None and hold.rolling_slot is not None:
                rolling[hold.rolling_pos] = {n: b[:, hold.rolling_slot].clone() for n, b in buffers.items()}
        return found, rolling

    plain, _ = states_by_length(make_llm(model_path))
    for right in (1, K):
        spec = make_llm(model_path, NGRAM)
        spec.engine.spec.drafter = ForcedDrafter([prompt + ref], right)
        found, rolling = states_by_length(spec)
        lengths = [n for n in found if n > len(prompt)]
        assert len(lengths) >= 3
        inside = [pos for pos in rolling if pos > len(prompt) and pos not in found]
        if right == K:
            assert inside, "no page boundary fell inside a window"
        for n, states in [(n, found[n]) for n in lengths] + [(pos, rolling[pos]) for pos in inside]:
            for name, state in states.items():
                # the window's attention runs the multi-token path: rounding-level differences
                torch.testing.assert_close(state, plain[n][name], rtol=1e-5, atol=1e-5, msg=f"{name} at {n}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "page, k, right, at, window",
    [
        (8, 3, 3, 0, 0),  # the boundary right after the window's first token, every draft accepted
        (8, 4, 0, 0, 1),  # ... and every draft rejected
        (8, 3, 2, 1, 1),  # at a middle accepted draft, the next draft rejected
        (8, 3, 2, 2, 0),  # at the last accepted draft (the window's end), the next draft rejected
        (16, 4, 1, 1, 2),  # at the last accepted draft, the next draft rejected
        (4, 2, 2, 2, 1),  # at the window's end, every draft accepted
        (16, 5, 4, 2, 1),  # in the middle of a long window, the last draft rejected
    ],
)
def test_cache_hit_on_a_boundary_crossed_inside_a_window(
    model_path, hf_reference, page, k, right, at, window
):
    """A page boundary reached at accepted position `at` of the request's `window`-th
    verification window: at release the prefix cache keeps the state there, and a later request
    that extends that prefix starts from it with the greedy tokens of an engine without the
    prefix cache (and of transformers). Long-memory layers: a state off by a token changes them."""
    boundary = 3 * page
    # windows start after the prompt and each advances `right + 1` tokens
    length = boundary - at - 1 - window * (right + 1)
    new = 1 + (window + 1) * (right + 1) + 1  # the windows, then one plain decode: ends before the next page
    first = prompts_of([length], seed=20 + page + k)[0]
    ref = reference(model_path, [first], new)[0]
    llm = make_llm(model_path, {**NGRAM, "num_speculative_tokens": k}, page_size=page)
    llm.engine.spec.drafter = ForcedDrafter([first + ref], right)
    windows: list[tuple[int, int]] = []  # (computed length before, accepted)
    verify = llm.engine.spec.verify  # type: ignore[union-attr]

    def spy(logits, reqs, drafts):
        verdicts = verify(logits, reqs, drafts)
        windows.extend((r.num_computed_tokens, v.num_accepted) for r, v in zip(reqs, verdicts))
        return verdicts

    llm.engine.spec.verify = spy  # type: ignore[union-attr, method-assign]
    assert run(llm, [first], greedy(new)) == [ref]
    assert windows[window] == (boundary - at - 1, right), windows
    assert all(start + accepted + 1 < boundary + page for start, accepted in windows)
    second = (first + ref)[:boundary] + prompts_of([7], seed=21)[0]
    cold = run(make_llm(model_path, cache_type="naive"), [second], greedy())[0]
    assert cold == hf_reference(model_path, [second], NEW)[0]
    llm.engine.spec.drafter = ForcedDrafter([second + cold], right)
    out = llm.generate([{"prompt_token_ids": second}], greedy(), use_tqdm=False)[0]
    assert out.num_cached_tokens == boundary  # the snapshot taken inside the window
    assert out.outputs[0].token_ids == cold


@pytest.mark.slow
@pytest.mark.parametrize(
    "page, k, length, new, how",
    [
        (8, 3, 13, 4, "length"),  # stops on the page boundary, one draft short of the window's end
        (8, 3, 13, 5, "stop"),  # stops at the window's end, a token past the boundary
        (8, 4, 14, 4, "length"),  # stops a token past a boundary crossed mid-window
        (8, 3, 5, 12, "stop"),  # the third window: earlier windows crossed a boundary too
    ],
)
def test_stop_inside_a_window_caches_as_plain_decoding(model_path, page, k, length, new, how):
    """A request that stops inside a verification window (max_tokens or a stop token) leaves the
    prefix cache what plain decoding leaves: the next turn hits as many tokens, with the same
    greedy tokens."""
    first = prompts_of([length], seed=30 + length + new)[0]
    ref = reference(model_path, [first], new)[0]
    if how == "stop":
        assert ref[-1] not in ref[:-1]
        params = greedy(NEW, stop_token_ids=[ref[-1]])
    else:
        params = greedy(new)
    second = first + ref + prompts_of([7], seed=31)[0]
    cached, outs = [], []
    for spec in (None, {**NGRAM, "num_speculative_tokens": k}):
        llm = make_llm(model_path, spec, page_size=page)
        if spec is not None:
            llm.engine.spec.drafter = ForcedDrafter([first + ref, second + outs[0]], k)
        assert run(llm, [first], params) == [ref]
        if spec is not None:  # every token after the first came from a window, the last too
            s, windows = llm.engine.stats(), -(-(new - 1) // (k + 1))
            assert s["spec_windows_total"] == windows
            assert s["spec_accepted_tokens_total"] >= new - 1 - windows
        out = llm.generate([{"prompt_token_ids": second}], greedy(), use_tqdm=False)[0]
        cached.append(out.num_cached_tokens)
        outs.append(out.outputs[0].token_ids)
    # the end state of the first request: its computed length's last page boundary
    assert cached[1] == cached[0] == (length + new - 1) // page * page
    assert outs[1] == outs[0]


def count_state_copies(llm: LLM) -> list[int]:
    """A one-element counter of slot-sized state copies: slot to slot, and window position to slot."""
    copies = [0]
    pool, window = llm.engine.runner.state_pool, llm.engine.spec.window if llm.engine.spec else None
    copy_slot = pool.copy_slot

    def counted_copy(src: int, dst: int) -> None:
        copies[0] += 1
        copy_slot(src, dst)

    pool.copy_slot = counted_copy  # type: ignore[method-assign]
    if window is not None:
        commit = window.commit

        def counted_commit(slots: list[int], rows: list[int], positions: list[int]) -> None:
            copies[0] += len(slots)
            commit(slots, rows, positions)

        window.commit = counted_commit  # type: ignore[method-assign]
    return copies


@pytest.mark.slow
@pytest.mark.parametrize("cache_type", ["radix", "naive"])
@pytest.mark.parametrize(
    "page, k, right, length, new, ends_in_window",
    [
        (8, 3, 3, 4, 18, False),  # page boundaries (8, 16) at windows' last accepted positions
        (8, 3, 2, 5, 17, False),  # 8 at a window's last accepted position, 16 in the middle of one
        (8, 4, 4, 6, 17, False),  # 8 at a window's second position, 16 at a window's last
        (8, 3, 0, 5, 7, False),  # every draft rejected: 8 at a one-position window
        (8, 3, 3, 5, 13, True),  # max_tokens ends the third window, a token past 16 crossed mid-window
    ],
)
def test_windows_copy_states_no_more_than_needed(
    model_path, cache_type, page, k, right, length, new, ends_in_window
):
    """A window copies its last accepted state into the working slot once, if the request goes
    on, and a page boundary inside it costs the one copy into the prefix cache's rolling
    snapshot that plain decoding makes there, with the same tokens and the same next-turn hits."""
    first = prompts_of([length], seed=40 + length + new)[0]
    ref = reference(model_path, [first], new)[0]
    second = first + ref + prompts_of([7], seed=41)[0]
    results = []
    for spec in (None, {**NGRAM, "num_speculative_tokens": k}):
        llm = make_llm(model_path, spec, page_size=page, cache_type=cache_type)
        copies = count_state_copies(llm)
        if spec is not None:
            llm.engine.spec.drafter = ForcedDrafter([first + ref], right)
        assert run(llm, [first], greedy(new)) == [ref]
        windows = llm.engine.stats()["spec_windows_total"] if spec is not None else 0
        results.append((copies[0], windows))
        out = llm.generate([{"prompt_token_ids": second}], greedy(), use_tqdm=False)[0]
        results.append((out.num_cached_tokens, out.outputs[0].token_ids))
    (plain_copies, _), plain_next, (spec_copies, windows), spec_next = results
    assert windows == (new - 2) // (right + 1) + ends_in_window
    # each window that the request outlives commits its last accepted state, and only that
    assert spec_copies == plain_copies + windows - ends_in_window
    assert spec_next == plain_next


def test_ngram_on_self_repeating_batch(model_path, pools_held):
    """The 'done when' check: batched self-repeating prompts, greedy identical, drafts accepted."""
    prompts = prompts_of([4, 7, 11, 3], seed=3, repeat=6) + prompts_of([50], seed=4)
    ref = reference(model_path, prompts)
    llm = make_llm(model_path, NGRAM, max_running_requests=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert sum(o.num_accepted_tokens for o in outs) > 0
    s = llm.engine.stats()
    assert s["spec_accepted_tokens_total"] == sum(o.num_accepted_tokens for o in outs) > 0
    assert s["spec_draft_tokens_total"] == sum(o.num_draft_tokens for o in outs)
    assert not pools_held(llm)


def test_mixed_batches_and_multi_turn_cache_hits(remembering_checkpoint, pools_held):
    """Requests verifying drafts beside others prefilling in the same forward; then a second
    turn that extends each sequence hits snapshots taken from committed states."""
    path = remembering_checkpoint("qwen3_5")
    prompts = prompts_of([3, 5, 130, 90], seed=5, repeat=2)
    ref = reference(path, prompts)
    llm = make_llm(path, NGRAM, max_running_requests=4)
    drafter = ForcedDrafter([p + r for p, r in zip(prompts, ref)], right=2)
    llm.engine.spec.drafter = drafter
    mixed = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        plan = schedule()
        if plan is not None:
            prefilling = len(plan.chunks) > plan.num_decodes + plan.num_verify
            mixed.append(plan.num_verify > 0 and prefilling)
        return plan

    llm.engine.scheduler.schedule = spy  # type: ignore[method-assign]
    assert run(llm, prompts, greedy()) == ref
    assert any(mixed)
    second = [p + r + [7, 8, 9] for p, r in zip(prompts, ref)]
    ref2 = reference(path, second)
    drafter.sequences += [p + r for p, r in zip(second, ref2)]
    before = llm.engine.stats()["prefix_cache_hit_tokens"]
    assert run(llm, second, greedy()) == ref2
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > before
    assert not pools_held(llm)


def test_stops_inside_a_window_and_aborts(remembering_checkpoint, pools_held):
    path = remembering_checkpoint("qwen3_5")
    prompts = prompts_of([20, 40, 9], seed=6)
    ref = reference(path, prompts)
    llm = make_llm(path, NGRAM, max_running_requests=4)
    llm.engine.spec.drafter = ForcedDrafter([p + r for p, r in zip(prompts, ref)], right=K)
    # a stop token that ends the first request in the middle of an accepted window
    stop_at = 6
    params = greedy(stop_token_ids=[ref[0][stop_at]])
    out = run(llm, [prompts[0]], params)[0]
    assert out == ref[0][: ref[0].index(ref[0][stop_at]) + 1]
    # an abort between steps, while the others keep verifying
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"a{i}", p, greedy())
    finished: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o.outputs[0].token_ids
        steps += 1
        if steps == 5:
            eng.abort_request("a1")
    assert finished["a0"] == ref[0] and finished["a2"] == ref[2]
    assert finished["a1"] == ref[1][: len(finished["a1"])]
    assert not pools_held(llm)


def test_sampling_with_drafts_runs_and_is_seeded(make_checkpoint):
    path = make_checkpoint("qwen3_5")
    prompts = prompts_of([6, 8], seed=7, repeat=5)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW, ignore_eos=True, seed=11)
    a = run(make_llm(path, NGRAM), prompts, params)
    b = run(make_llm(path, NGRAM), prompts, params)
    assert a == b and all(len(x) == NEW for x in a)


def test_rejection_sampling_keeps_the_target_distribution():
    """A point-mass draft accepted with p(d), else the residual: the output law is p."""
    from deltaserve.engine.sampling.sampler import Sampler
    from deltaserve.engine.spec_decode.rejection import _rejection_sample

    class View:
        generator = None
        matcher = None
        thinking = None
        error = None
        output_token_ids: list[int] = []
        all_token_ids: list[int] = []
        params = SamplingParams(temperature=1.0)

    sampler = Sampler(torch.device("cpu"), 0, [])
    p = torch.tensor([0.1, 0.5, 0.15, 0.25])
    logits = p.log().repeat(2, 1)
    counts = torch.zeros(4)
    trials = 4000
    for _ in range(trials):
        counts[_rejection_sample(sampler, logits, [View(), View()], [2])[0]] += 1  # type: ignore[list-item]
    torch.testing.assert_close(counts / trials, p, atol=0.03, rtol=0)


def test_config_validation(make_checkpoint):
    path = make_checkpoint("qwen3_5")
    with pytest.raises(ValueError):
        make_llm(path, {"method": "ngram"})
    with pytest.raises(ValueError):
        make_llm(path, {"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError):
        make_llm(path, {"method": "ngram", "num_speculative_tokens": 0})


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_speculative_tokens", 2.5),
        ("num_speculative_tokens", "3"),
        ("num_speculative_tokens", None),
        ("num_speculative_tokens", True),
        ("prompt_lookup_max", "4"),
        ("prompt_lookup_min", 1.0),
        ("prompt_lookup_max", None),
        ("max_batch", 1.5),
        ("cuda_graph", "false"),
        ("method", ["ngram"]),
    ],
)
def test_config_of_the_wrong_type_is_refused_naming_its_key(key, value):
    """A speculative_config value of the wrong type is a ValueError naming the key, from the CLI
    too, before the model loads: 2.5 drafts passed the check and failed the load with torch's
    TypeError, "3" failed with "'<' not supported between instances of 'str' and 'int'"."""
    from deltaserve.engine.spec_decode.config import SpecConfig
    from deltaserve.server.cli import build_parser

    raw = {"method": "ngram", "num_speculative_tokens": 2, key: value}
    with pytest.raises(ValueError, match=key):
        SpecConfig.from_dict(raw)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", json.dumps(raw)])


def test_cli_and_metrics(make_checkpoint):
    from deltaserve.server.cli import build_parser
    from deltaserve.server.metrics import Metrics

    args = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    llm = make_llm(make_checkpoint("qwen3_5"), args.speculative_config)
    run(llm, prompts_of([5], seed=8, repeat=4), greedy())
    text = Metrics("m").render(llm.engine.stats())
    s = llm.engine.stats()
    rate = s["spec_accepted_tokens_total"] / s["spec_draft_tokens_total"]
    assert f'deltaserve_spec_decode_acceptance_rate{{model_name="m"}} {rate}' in text
    assert "deltaserve_spec_decode_mean_accepted_length" in text


@pytest.mark.parametrize("pressure", [False, True])
def test_decodes_windows_and_prefills_in_one_batch(remembering_checkpoint, pressure, pools_held):
    """max_batch 2: the other decoding requests decode one token beside the windows and the
    prefills. Under KV pressure (few pages) drafts get pages only when free and decodes
    preempt; outputs stay exact either way."""
    path = remembering_checkpoint("qwen3_5")
    lengths = [60, 61, 62, 63] if pressure else [60, 61, 12, 35, 8]
    prompts = prompts_of(lengths, seed=9)
    ref = reference(path, prompts)
    spec = {**NGRAM, "max_batch": 2}
    pages = {"num_kv_pages": 11, "max_model_len": 128} if pressure else {}
    llm = make_llm(path, spec, max_running_requests=len(prompts), **pages)
    llm.engine.spec.drafter = ForcedDrafter([p + r for p, r in zip(prompts, ref)], right=2)
    kinds, preempted = [], []
    schedule = llm.engine.scheduler.schedule

    def spy():
        plan = schedule()
        if plan is not None:
            preempted.extend(plan.preempted)
            prefills = len(plan.chunks) - plan.num_decodes - plan.num_verify
            kinds.append((plan.num_decodes, plan.num_verify, prefills))
        return plan

    llm.engine.scheduler.schedule = spy  # type: ignore[method-assign]
    assert run(llm, prompts, greedy()) == ref
    assert all(v <= 2 for _, v, _ in kinds)
    assert llm.engine.stats()["spec_accepted_tokens_total"] > 0
    if pressure:
        assert preempted
    else:
        assert any(d and v and p for d, v, p in kinds)
    assert not pools_held(llm)


def test_logprobs_and_penalties_through_windows(make_checkpoint):
    """Each accepted token's logprob and penalty are those of its own position."""
    path = make_checkpoint("qwen3_5")
    prompts = prompts_of([7, 9], seed=10, repeat=4)
    params = greedy(logprobs=2, repetition_penalty=1.3, min_tokens=5)
    plain = make_llm(path).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = make_llm(path, NGRAM)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, plain)]
    llm.engine.spec.drafter = ForcedDrafter(seqs, right=K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(outs, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.num_accepted_tokens > 0
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert la is not None and lb is not None and len(la) == len(lb)
        for x, y in zip(la, lb):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert x.top.keys() == y.top.keys()


def test_seeded_sampling_draws_plain_decodings_tokens(make_checkpoint):
    """A seeded request samples the tokens it samples without speculation, whatever its drafts:
    right ones are accepted, a wrong one gives plain decoding's token, and a prompt's last token
    run as a window (the 33-token prompt's, past its 32-token chunk) draws its first token."""
    path = make_checkpoint("qwen3_5")
    prompts = prompts_of([7, 33, 9], seed=15, repeat=1) + prompts_of([6], seed=16, repeat=5)
    params = [
        SamplingParams(temperature=0.9, seed=3, max_tokens=NEW, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.8, seed=4, top_k=40, max_tokens=NEW, ignore_eos=True),
        SamplingParams(
            temperature=0.7, seed=5, top_p=0.9, presence_penalty=0.5, max_tokens=NEW, ignore_eos=True
        ),
        SamplingParams(temperature=1.0, seed=6, min_p=0.01, max_tokens=NEW, ignore_eos=True),
    ]
    given = [{"prompt_token_ids": p} for p in prompts]
    plain = make_llm(path).generate(given, params, use_tqdm=False)
    llm = make_llm(path, NGRAM)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, plain)]
    llm.engine.spec.drafter = ForcedDrafter(seqs, right=2)
    outs = llm.generate(given, params, use_tqdm=False)
    for a, b in zip(outs, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.num_accepted_tokens > 0
    la, lb = outs[0].outputs[0].logprobs, plain[0].outputs[0].logprobs
    assert la is not None and lb is not None
    assert [x.token_id for x in la] == [x.token_id for x in lb]
    assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(la, lb))


class DraftsOutside(ForcedDrafter):
    """Proposes the true continuation for `right` tokens, then a token outside `allowed`."""

    def __init__(self, sequences: list[list[int]], right: int, allowed: list[int]) -> None:
        super().__init__(sequences, right)
        self.outside = next(t for t in range(self.vocab) if t not in allowed)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        drafts = super().propose(tokens, k)
        if len(drafts) > self.right:
            drafts[-1] = self.outside
        return drafts


def test_allowed_token_ids_through_windows(make_checkpoint):
    """Drafts of a token outside the allowed set are rejected: the tokens are plain decoding's."""
    path = make_checkpoint("qwen3_5")
    prompts = prompts_of([7, 9], seed=11, repeat=4)
    free = make_llm(path).generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    allowed = sorted({t for o in free for t in o.outputs[0].token_ids})[::2]  # half of what it chose
    params = greedy(allowed_token_ids=allowed)
    plain = make_llm(path).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = make_llm(path, NGRAM)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, plain)]
    llm.engine.spec.drafter = DraftsOutside(seqs, right=1, allowed=allowed)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(outs, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert set(a.outputs[0].token_ids) <= set(allowed)
        assert a.num_accepted_tokens > 0


def test_bad_words_through_windows(make_checkpoint):
    """Drafts that complete a bad word are rejected: the tokens are plain decoding's."""
    path = make_checkpoint("qwen3_5")
    prompts = prompts_of([7, 9], seed=12, repeat=4)
    free = make_llm(path).generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    bad = [o.outputs[0].token_ids[1:3] for o in free]  # a pair each free run writes
    params = greedy(bad_words_token_ids=bad)
    plain = make_llm(path).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = make_llm(path, NGRAM)
    # drafts follow the free runs while they can, so they propose each pair's last token; then plain's
    runs = [p + o.outputs[0].token_ids for outs in (free, plain) for p, o in zip(prompts, outs)]
    llm.engine.spec.drafter = ForcedDrafter(runs, right=K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(outs, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        seq = a.outputs[0].token_ids
        assert not any(seq[i : i + 2] in bad for i in range(len(seq) - 1))


class Repeats:
    """Proposes k copies of one token."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return [self.token] * k


def test_masks_that_empty_a_drafts_row_fail_the_request(make_checkpoint):
    """When the masks leave no token at a row the window reaches (after accepted drafts), the
    request fails there as plain decoding does, with no token sampled from that row."""
    path = make_checkpoint("qwen3_5")
    # 9 twice (5 stops, before min_tokens), then "9 9 9" is a bad word: nothing at the third
    params = greedy(
        allowed_token_ids=[9, 5], bad_words_token_ids=[[9, 9, 9]], stop_token_ids=[5], min_tokens=6
    )
    params.ignore_eos = False
    prompts = prompts_of([7, 9], seed=13, repeat=2)
    plain = make_llm(path).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = make_llm(path, NGRAM)
    llm.engine.spec.drafter = Repeats(9)  # the first draft is right, the second reaches the empty row
    spec = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for outs in (plain, spec):
        for out in outs:
            c = out.outputs[0]
            assert c.finish_reason == "error" and c.bad_input and "at output token 3:" in c.error, c
            assert set(c.token_ids) <= {9}
    assert sum(o.num_accepted_tokens for o in spec) > 0
    assert llm.engine.stats()["state_slots_used"] == 0


@pytest.mark.slow
def test_uniform_windows_for_verification_graphs(model_path, pools_held):
    """`cuda_graph`: every decoding request verifies exactly k drafts (padded where the n-gram
    lookup finds fewer or none), so that verification batches have one shape; greedy output is
    unchanged, and while requests have room every window holds k drafts."""
    prompts = prompts_of([4, 7, 11, 3], seed=3, repeat=6) + prompts_of([50, 9], seed=4)
    ref = reference(model_path, prompts)
    llm = make_llm(model_path, {**NGRAM, "cuda_graph": True}, max_running_requests=8)
    widths: list[int] = []
    verify = llm.engine.spec.verify  # type: ignore[union-attr]

    def spy(logits, reqs, drafts):
        widths.extend(len(d) for d in drafts)
        return verify(logits, reqs, drafts)

    llm.engine.spec.verify = spy  # type: ignore[union-attr, method-assign]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert widths and widths.count(K) >= len(widths) - len(prompts) * K  # short only near max_tokens
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert not pools_held(llm)
