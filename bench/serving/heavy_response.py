"""How long one heavy response (unstreamed, or streamed) freezes a concurrent greedy stream.

    python -m bench.serving.heavy_response [--kind completions|echo|generate|batch] [--n 128]

Starts a real server with the built-in model, keeps greedy streamed completions running from a
thread, and sends one heavy request beside them: `/v1/completions` with `n` choices and
`prompt_logprobs=20` on a prompt of `--prompt-len` random token ids (`echo`: with `echo` and
`logprobs=20` too), or `/generate` with `n` and `logprob_start_len=0`, or (`batch`) `/generate`
with `n` greedy one-token prompts of one new token each; `--stream` streams it (completions then
without `prompt_logprobs`, which streams refuse), and `--stream-temperature` samples the streams. Reports the heavy
request's time and body size, and the stream's usual (median) and longest gap between chunks
while the heavy request was in flight. Runs on any machine; the figures belong to its CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx


def _heavy_request(kind: str, n: int, prompt: list[int], model: str) -> tuple[str, dict[str, object]]:
    if kind == "batch":
        return "/generate", {
            "input_ids": [[t] for t in (prompt * n)[:n]],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        }
    if kind == "generate":
        return "/generate", {
            "input_ids": prompt,
            "sampling_params": {"n": n, "max_new_tokens": 8, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 20,
        }
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "n": n,
        "max_tokens": 8,
        "temperature": 1.0,
        "prompt_logprobs": 20,
    }
    if kind == "echo":
        body.update(echo=True, logprobs=20)
    return "/v1/completions", body


class _Streamer(threading.Thread):
    """Streamed completions (greedy unless given a temperature), one after another, each chunk's
    arrival time kept."""

    def __init__(self, url: str, model: str, temperature: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.stop = url, model, threading.Event()
        self.temperature = temperature
        self.arrivals: list[list[float]] = []

    def run(self) -> None:
        body = {
            "model": self.model,
            "prompt": "Once upon a time",
            "max_tokens": 200,
            "temperature": self.temperature,
            "stream": True,
        }
        body["ignore_eos"] = True
        with httpx.Client(timeout=120) as http:
            while not self.stop.is_set():
                times: list[float] = []
                self.arrivals.append(times)
                with http.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: "):
                            times.append(time.monotonic())

    def gaps(self, start: float, end: float) -> list[tuple[float, float]]:
        """Gaps between chunks of one stream that end from `start` to a second past `end`, each with
        when it ended (seconds after `start`)."""
        out = []
        for times in self.arrivals:
            out += [(b - a, b - start) for a, b in zip(times, times[1:]) if start <= b <= end + 1.0]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=["completions", "echo", "generate", "batch"], default="completions")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--port", type=int, default=18731)
    ap.add_argument("--stream", action="store_true", help="stream the heavy request (its events read whole)")
    ap.add_argument(
        "--stream-temperature", type=float, default=0.0, help="the concurrent streams' temperature"
    )
    args = ap.parse_args()

    url = f"http://127.0.0.1:{args.port}"
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "deltaserve", "serve", "--port", str(args.port), "--max-model-len", "2048"]
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not come up; its log: {log.name}")
            time.sleep(0.5)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        streamer = _Streamer(url, model, args.stream_temperature)
        streamer.start()
        time.sleep(3)  # the stream settles into its pace
        prompt = [random.Random(0).randrange(1000, 20000) for _ in range(args.prompt_len)]
        path, body = _heavy_request(args.kind, args.n, prompt, model)
        if args.stream:  # a completions stream has no place for prompt_logprobs (a 400)
            body["stream"] = True
            body.pop("prompt_logprobs", None)
        start = time.monotonic()
        resp = httpx.post(f"{url}{path}", json=body, timeout=600)
        end = time.monotonic()
        resp.raise_for_status()
        time.sleep(1)
        streamer.stop.set()
        gaps = streamer.gaps(start, end)
        longest = max(gaps, default=(None, None))
        print(
            json.dumps(
                {
                    "kind": args.kind,
                    "stream_temperature": args.stream_temperature,
                    "stream": args.stream,
                    "n": args.n,
                    "heavy_s": round(end - start, 2),
                    "body_mb": round(len(resp.content) / 1e6, 1),
                    "stream_gap_median_s": round(statistics.median(g for g, _ in gaps), 3) if gaps else None,
                    "stream_gap_max_s": round(longest[0], 2) if gaps else None,
                    "stream_gap_max_ended_at_s": round(longest[1], 2) if gaps else None,
                }
            )
        )
    finally:
        print(f"server log: {log.name}", file=sys.stderr)
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
