"""The detokenizer keeps its text in chunks: whatever is asked of it (the whole text, its
length, its tail, a cut) matches the plain concatenation of the pieces it returned."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer
from deltaserve.models.checkpoints.builtin import builtin_model_path


def test_text_tail_and_cut_match_the_concatenated_pieces():
    tokenizer = AutoTokenizer.from_pretrained(builtin_model_path())
    rng = random.Random(0)
    detok = IncrementalDetokenizer(tokenizer)
    pieces: list[str] = []
    for step in range(5 * IncrementalDetokenizer.MERGE + 7):  # several merges of chunks
        pieces.append(detok.append(rng.randrange(0, 5000)))
        if step % 37 == 0:  # asking for the whole text in between joins the chunks
            assert detok.text == "".join(pieces)
        want = "".join(pieces)
        assert detok.length == len(want)
        for n in (0, 1, 5, 64, len(want) // 2, len(want), len(want) + 3):
            assert detok.tail(n) == (want[max(0, len(want) - n) :] if n else "")
    pieces.append(detok.flush())
    want = "".join(pieces)
    assert detok.text == want and len(want) > 100
    detok.truncate(len(want) - 10)
    assert detok.text == want[:-10] and detok.length == len(want) - 10 and detok.tail(4) == want[-14:-10]
