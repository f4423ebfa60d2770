"""Host cost of a streamed chat choice's parsing per step as its output grows.

    python -m bench.serving.stream_parse [--chars 200000] [--piece 5] [--tools]

A synthetic Qwen reasoning output (`<think>` ... `</think>` then content, with a tool call at
the end under `--tools`) arrives in pieces of `--piece` characters, as a stream's steps deliver
it. Two ways of turning the pieces into deltas are timed, in microseconds per step over ranges
of the output's length:
  reparse      parse the whole text so far every step and send what grew (the baseline: a
               cost that grows with the text)
  incremental  `ChatStreamState.feed` with the new piece only (what streams do)
"""

from __future__ import annotations

import argparse
import json
import time

from deltaserve.server.text.chat_output import ChatOutputParser, ChatStreamState

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}


def synthetic_output(chars: int, tools: bool) -> str:
    words = "let me think about this step by step and check each case again\n".split(" ")
    parts, n, i = ["<think>\n"], 0, 0
    while n < chars * 0.8:
        parts.append(words[i % len(words)] + " ")
        n += len(parts[-1])
        i += 1
    parts.append("\n</think>\n\n")
    while n < chars:
        parts.append(words[i % len(words)] + " ")
        n += len(parts[-1])
        i += 1
    if tools:
        parts.append('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    return "".join(parts)


def time_mode(mode: str, text: str, piece: int, parser: ChatOutputParser, marks: list[int]) -> list[float]:
    state = ChatStreamState(parser)
    sent_r = sent_c = 0
    rows: list[float] = []
    steps, t = 0, time.perf_counter()
    for start in range(0, len(text), piece):
        end = min(start + piece, len(text))
        final = end == len(text)
        if mode == "incremental":
            state.feed(text[start:end], final)
        else:
            parsed = parser.parse(text[:end], final)
            r, c = parsed.reasoning or "", parsed.content
            _ = (r[sent_r:], c[sent_c:])
            sent_r, sent_c = len(r), len(c)
        steps += 1
        if end >= marks[len(rows)]:
            now = time.perf_counter()
            rows.append((now - t) / steps * 1e6)
            t, steps = now, 0
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--chars", type=int, default=200_000, help="length of the output (about 4 characters a token)"
    )
    ap.add_argument("--piece", type=int, default=5, help="characters a step adds")
    ap.add_argument("--tools", action="store_true", help="parse tool calls too (a call at the end)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    text = synthetic_output(args.chars, args.tools)
    parser = ChatOutputParser(tools=TOOLS if args.tools else None)
    marks = [m for m in (5_000, 40_000, 160_000) if m < len(text)] + [len(text)]
    result = {m: time_mode(m, text, args.piece, parser, marks) for m in ("reparse", "incremental")}
    spans = [f"{a:,}-{b:,}" for a, b in zip([0] + marks[:-1], marks)]
    print(f"µs per step ({args.piece} characters a step{', tool calls parsed' if args.tools else ''})")
    print(f"{'characters':>16} " + " ".join(f"{m:>12}" for m in result))
    for i, span in enumerate(spans):
        print(f"{span:>16} " + " ".join(f"{result[m][i]:12.2f}" for m in result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "spans": spans, "us_per_step": result}, f, indent=1)


if __name__ == "__main__":
    main()
