"""Host cost of incremental detokenization per token as a request's output grows.

    python -m bench.serving.detokenize [--tokens 64000] [--model PATH] [--byte-run]

Appends random token ids to one `IncrementalDetokenizer` (the built-in model's tokenizer by
default) and prints microseconds per token over ranges of the output's length: with a cost
that grows with the text, a long reasoning output at a large batch shows it on every step.
`--byte-run` appends one byte token that is no UTF-8 on its own, again and again (what random
weights or a derailed model can emit): text that never completes a character.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoTokenizer

from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the built-in tiny model)")
    ap.add_argument("--tokens", type=int, default=64000)
    ap.add_argument("--byte-run", action="store_true", help="one incomplete byte token repeated")
    args = ap.parse_args()
    if args.model is None:
        from deltaserve.models.checkpoints.builtin import builtin_model_path

        args.model = builtin_model_path()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(len(tokenizer), 150000), (args.tokens,), generator=gen).tolist()
    if args.byte_run:
        byte = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")
        ids = [byte] * args.tokens
    marks = [m for m in (1000, 8000, 32000, 64000, 128000) if m < args.tokens] + [args.tokens]
    detok = IncrementalDetokenizer(tokenizer)
    rows, start, t = [], 0, time.perf_counter()
    for i, token in enumerate(ids, 1):
        detok.append(token)
        if i == marks[len(rows)]:
            now = time.perf_counter()
            rows.append(
                {
                    "tokens": f"{start}-{i}",
                    "us_per_token": 1e6 * (now - t) / (i - start),
                    "chars": len(detok.text),
                }
            )
            start, t = i, now
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
