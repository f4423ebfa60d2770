"""Multi-turn chat through the HTTP server: how much of each prompt the prefix cache serves.

Sessions share a system prompt and run their turns one after another; `--concurrency` sessions
run at once. Each turn sends the whole conversation so far (system prompt, earlier user messages,
the answers the server gave, re-rendered by its chat template) plus a new user message to
/v1/chat/completions, streamed, temperature 0, `max_tokens` answers. Every `--retry-every`-th turn
of a session is sent a second time, unchanged, as a client retry would.

For each request it records the prompt tokens, the cached tokens the server reports
(`usage.prompt_tokens_details.cached_tokens`) and TTFT. The ideal is the share of the prompt that
some earlier request had already sent: the longest common token prefix with any earlier prompt
(prompt ids from the server's /tokenize with the same messages). Tokens the model generated are
not in the ideal, so a cache that also keeps what it generated can exceed it.

    python -m bench.serving.chat_sessions --base-url http://127.0.0.1:8000 --sessions 32 --turns 4 \
        --output-json chat.json
    # the same against a server started with --cache-type naive, for TTFT without reuse
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

_SYLLABLES = [c + v for c in "bcdfghklmnprstvz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def words(rng: random.Random, n: int) -> str:
    """Pseudo-English text: words of one to three syllables, a sentence every dozen words."""
    out = []
    for i in range(n):
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
        out.append(word + ("." if i % 12 == 11 else ""))
    return " ".join(out)


@dataclass
class Turn:
    session: int
    turn: int
    retry: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ideal_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    error: str | None = None


class SentPrompts:
    """Every prompt sent so far, sorted, so that the longest common prefix of a new prompt with
    any of them is that with one of its two neighbours in the order."""

    def __init__(self) -> None:
        self.sorted: list[tuple[int, ...]] = []

    def longest_prefix(self, ids: tuple[int, ...]) -> int:
        i = bisect.bisect_left(self.sorted, ids)
        best = 0
        for j in (i - 1, i):
            if 0 <= j < len(self.sorted):
                best = max(best, _common(self.sorted[j], ids))
        return best

    def add(self, ids: tuple[int, ...]) -> None:
        bisect.insort(self.sorted, ids)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Chat:
    def __init__(self, args: argparse.Namespace, client: httpx.AsyncClient, model: str) -> None:
        self.args = args
        self.client = client
        self.model = model
        self.sent = SentPrompts()
        self.results: list[Turn] = []
        self.system = words(random.Random(f"{args.seed}-system"), args.system_words)

    async def tokenize(self, messages: list[dict[str, str]]) -> tuple[int, ...]:
        resp = await self.client.post(
            f"{self.args.base_url}/tokenize", json={"model": self.model, "messages": messages}
        )
        resp.raise_for_status()
        return tuple(resp.json()["tokens"])

    async def send(self, res: Turn, messages: list[dict[str, str]]) -> str:
        ids = await self.tokenize(messages)
        res.ideal_tokens = self.sent.longest_prefix(ids)
        self.sent.add(ids)
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.args.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        text: list[str] = []
        start = time.perf_counter()
        try:
            async with self.client.stream(
                "POST", f"{self.args.base_url}/v1/chat/completions", json=body
            ) as resp:
                if resp.status_code != 200:
                    res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    return ""
                async for line in resp.aiter_lines():
                    data = line[5:].strip() if line.startswith("data:") else ""
                    if not data or data == "[DONE]":
                        continue
                    payload = json.loads(data)
                    if "error" in payload:
                        res.error = str(payload["error"])[:200]
                        return ""
                    for choice in payload.get("choices") or []:
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - start
                        text.append(choice.get("delta", {}).get("content") or "")
                    usage = payload.get("usage")
                    if usage:
                        res.prompt_tokens = int(usage["prompt_tokens"])
                        details = usage.get("prompt_tokens_details") or {}
                        res.cached_tokens = int(details.get("cached_tokens") or 0)
        except httpx.HTTPError as exc:
            res.error = f"{type(exc).__name__}: {exc}"[:200]
            return ""
        res.e2e = time.perf_counter() - start
        return "".join(text)

    async def session(self, s: int) -> None:
        rng = random.Random(f"{self.args.seed}-session-{s}")
        messages = [{"role": "system", "content": self.system}]
        for t in range(self.args.turns):
            messages.append({"role": "user", "content": words(rng, self.args.user_words)})
            retries = 1 if self.args.retry_every and (t + 1) % self.args.retry_every == 0 else 0
            answer = ""
            for attempt in range(1 + retries):
                res = Turn(session=s, turn=t + 1, retry=attempt > 0)
                self.results.append(res)
                text = await self.send(res, list(messages))
                answer = answer if attempt else text
            messages.append({"role": "assistant", "content": answer})


async def run(args: argparse.Namespace) -> dict[str, Any]:
    timeout = httpx.Timeout(args.timeout)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = args.model or (await client.get(f"{args.base_url}/v1/models")).json()["data"][0]["id"]
        chat = Chat(args, client, model)
        if args.warmup:  # compilation and allocator costs stay out of the timed turns
            await chat.send(Turn(-1, 0, False), [{"role": "user", "content": words(random.Random(1), 50)}])
            chat.sent = SentPrompts()
        queue = list(range(args.sessions))
        start = time.perf_counter()

        async def worker() -> None:
            while queue:
                await chat.session(queue.pop(0))

        await asyncio.gather(*(worker() for _ in range(min(args.concurrency, args.sessions))))
        duration = time.perf_counter() - start
    return summarize(args, chat.results, duration)


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def _group(turns: list[Turn]) -> dict[str, Any]:
    ok = [t for t in turns if t.error is None]
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    ideal = sum(t.ideal_tokens for t in ok)
    ttft = [t.ttft * 1e3 for t in ok if t.ttft is not None]
    return {
        "requests": len(turns),
        "failed": len(turns) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ideal_tokens": ideal,
        "cached_share": cached / prompt if prompt else None,
        "ideal_share": ideal / prompt if prompt else None,
        "cached_over_ideal": cached / ideal if ideal else None,
        "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
        "ttft_ms_p50": _p(ttft, 50),
        "ttft_ms_p90": _p(ttft, 90),
    }


def summarize(args: argparse.Namespace, turns: list[Turn], duration: float) -> dict[str, Any]:
    by_turn = {
        f"turn {n}": _group([t for t in turns if t.turn == n and not t.retry])
        for n in range(1, args.turns + 1)
    }
    return {
        "config": {k: v for k, v in vars(args).items() if k != "output_json"},
        "duration_s": duration,
        "all": _group(turns),
        "first_turns": _group([t for t in turns if t.turn == 1 and not t.retry]),
        "later_turns": _group([t for t in turns if t.turn > 1 and not t.retry]),
        "retries": _group([t for t in turns if t.retry]),
        "by_turn": by_turn,
        "requests": [asdict(t) for t in turns],
    }


def _fmt(v: Any, nd: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def print_report(result: dict[str, Any]) -> None:
    rows = [("all", result["all"]), ("first turns", result["first_turns"])]
    rows += [("later turns", result["later_turns"]), ("retries", result["retries"])]
    rows += list(result["by_turn"].items())
    print(
        f"{'requests':<12} {'n':>5} {'fail':>4} {'prompt':>9} {'cached':>8} {'ideal':>8} "
        f"{'cached/ideal':>12} {'TTFT p50':>9} {'p90 ms':>8}"
    )
    for name, g in rows:
        print(
            f"{name:<12} {g['requests']:>5} {g['failed']:>4} {g['prompt_tokens']:>9} "
            f"{_fmt(g['cached_share'], 3):>8} {_fmt(g['ideal_share'], 3):>8} "
            f"{_fmt(g['cached_over_ideal'], 3):>12} {_fmt(g['ttft_ms_p50'], 1):>9} {_fmt(g['ttft_ms_p90'], 1):>8}"
        )
    print(f"duration {result['duration_s']:.1f} s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="the served model's name (default: the first of /v1/models)")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16, help="sessions running at once")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=600, help="the shared system prompt's length")
    ap.add_argument("--user-words", type=int, default=60, help="each user message's length")
    ap.add_argument("--max-tokens", type=int, default=128, help="each answer's length")
    ap.add_argument("--retry-every", type=int, default=2, help="resend every n-th turn once (0: never)")
    ap.add_argument("--warmup", type=int, default=1, help="1: one untimed request first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--output-json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print_report(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    if result["all"]["failed"]:
        print(f"{result['all']['failed']} requests failed", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
