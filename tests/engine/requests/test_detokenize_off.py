"""`SamplingParams.detokenize=False`: the engine sends token ids without text, and a decoder on the
caller's side (as the server's client runs one) rebuilds exactly the text the engine would send."""

from __future__ import annotations

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer
from deltaserve.engine.requests.sampling_params import SamplingParams


def run(engine: Engine, detokenize: bool, tag: str) -> dict[str, list[tuple[list[int], str, bool]]]:
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=40, ignore_eos=True, output_kind="delta", detokenize=detokenize
    )
    prompts = {f"{tag}{i}": [100 + 37 * i + j for j in range(9 + i)] for i in range(3)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    seen: dict[str, list[tuple[list[int], str, bool]]] = {rid: [] for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            seen[out.request_id].append((list(c.token_ids), c.text, out.finished))
    return {rid[len(tag) :]: v for rid, v in seen.items()}


@pytest.mark.slow
def test_caller_side_text_equals_the_engines(tokenized_checkpoint: str) -> None:
    engine = Engine(
        EngineConfig(model=tokenized_checkpoint, dtype="float32", device="cpu", max_model_len=256)
    )
    with_text, without = run(engine, True, "a"), run(engine, False, "b")
    for key, steps in without.items():
        assert [s[0] for s in steps] == [s[0] for s in with_text[key]]  # the same tokens
        assert all(text == "" for _, text, _ in steps)  # and no text from the engine
        detok = IncrementalDetokenizer(engine.tokenizer)
        rebuilt = ""
        for tokens, _, finished in steps:
            for t in tokens:
                rebuilt += detok.append(t)
            if finished:
                rebuilt += detok.flush()
        assert rebuilt == "".join(text for _, text, _ in with_text[key])
        assert rebuilt  # the random model's 40 tokens decode to something


def test_stop_strings_need_the_text() -> None:
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(stop=["x"], detokenize=False)
