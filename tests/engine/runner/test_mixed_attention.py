"""`DELTASERVE_MIXED_ATTENTION=split`: in a step with prefill chunks the decode rows attend by the
decode path and the rest by the prefill path, and the tokens stay transformers'."""

from __future__ import annotations

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.engine.runner import attention_backend

A = list(range(1, 21))
B = list(range(30, 61))


def run(path: str) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
    """ "a" decodes while "b" arrives (a mixed step); the tokens, and each attention call's
    (query rows, max_seqlen_q)."""
    calls: list[tuple[int, int]] = []
    original = attention_backend.paged_attention

    def spy(q, *args):
        calls.append((int(q.shape[0]), int(args[-1])))
        return original(q, *args)

    engine = Engine(
        EngineConfig(model=path, dtype="float32", device="cpu", max_model_len=128, max_running_requests=4)
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", A, greedy)
    engine.step()
    engine.step()  # "a" decodes
    attention_backend.paged_attention = spy
    try:
        engine.add_request("b", B, greedy)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
    finally:
        attention_backend.paged_attention = original
    return tokens, calls


@pytest.fixture(scope="module")
def path(make_checkpoint) -> str:
    return make_checkpoint("qwen3_next")


def test_split_mode_attends_decode_rows_apart_with_the_same_tokens(path, hf_reference, monkeypatch) -> None:
    monkeypatch.setenv("DELTASERVE_MIXED_ATTENTION", "joint")
    joint_tokens, joint_calls = run(path)
    monkeypatch.setenv("DELTASERVE_MIXED_ATTENTION", "split")
    split_tokens, split_calls = run(path)
    assert split_tokens == joint_tokens
    assert [split_tokens["a"], split_tokens["b"]] == hf_reference(path, [A, B], 12)
    # the first step after "b" arrives is mixed: joint, its rows in one call a layer; split,
    # "a"'s decode row alone, then "b"'s chunk
    assert joint_calls[0][0] > 1 and joint_calls[0][1] > 1
    assert split_calls[0] == (1, 1) and split_calls[1][1] > 1
    prefill_calls = [i for i, (_, seqlen) in enumerate(split_calls) if seqlen > 1]
    assert all(split_calls[i - 1] == (1, 1) for i in prefill_calls)  # every layer, every mixed step
