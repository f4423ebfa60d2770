"""What the engine's steps were: the `step:` lines that the engine logs at debug level (the
server's `--log-level debug`, or `bench.serving.serve --offline-only --log-level debug`), summed per log.

    python -m bench.serving.step_timeline server.log offline.log --between 'GET /metrics|^offline c='

Each line gives a step's decode rows, verification rows, prefill chunks and tokens, and the time
since the step before; that time is charged to the step before (the one it ran), so a row reads:
how many steps, how many of them carried prefill chunks, and the mean wall time of a decode-only
step and of a step with prefill, and the latter's median, p90 and slowest. `--between REGEX` keeps
the steps after the first line that matches and before the last (bench.serving.serve scrapes the server's /metrics just before and after each
run, and prints "offline c=N" before and after its offline run); `--run K` keeps the K-th run's.
Where the server gives less than the offline engine on the same requests, this says whether it
ran more steps, other steps, or the same steps slower.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field

_STEP = re.compile(
    r"step: (?P<dec>\d+) decodes, (?P<ver>\d+) verifications, (?P<chunks>\d+) prefill chunks of "
    r"(?P<tok>\d+) tokens; (?:(?P<ms>[\d.]+) ms|-) since the last"
)


@dataclass
class Step:
    decodes: int
    prefill_chunks: int
    prefill_tokens: int
    ms: float | None = None  # its wall time: until the next step's plan


@dataclass
class Timeline:
    steps: list[Step] = field(default_factory=list)

    @classmethod
    def parse(cls, lines: list[str], between: str | None = None, run: int | None = None) -> Timeline:
        """The steps of one engine's log, each given the time until the next step's plan; with
        `between`, only those after the first line matching it and before the last, or with `run`
        (from 1) too, only those between that run's pair of marks (each run is marked before and
        after)."""
        if between is not None:
            marks = [i for i, line in enumerate(lines) if re.search(between, line)]
            if run is not None:
                marks = marks[2 * run - 2 : 2 * run]
            lines = lines[marks[0] + 1 : marks[-1]] if len(marks) > 1 else []
        steps: list[Step] = []
        for line in lines:
            m = _STEP.search(line)
            if m is None:
                continue
            if steps and m["ms"] is not None:
                steps[-1].ms = float(m["ms"])
            decodes = int(m["dec"]) + int(m["ver"])
            steps.append(Step(decodes, int(m["chunks"]), int(m["tok"])))
        return cls(steps)

    def summary(self, idle_ms: float | None = None) -> dict[str, float]:
        """The steps with a time (the last has none), those followed by a gap over `idle_ms` left
        out (the engine idle, not a step's time)."""
        timed = [s for s in self.steps if s.ms is not None and (idle_ms is None or s.ms <= idle_ms)]
        mixed = [s for s in timed if s.prefill_chunks]
        decode = [s for s in timed if not s.prefill_chunks]

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else 0.0

        def quantile(values: list[float], q: float) -> float:  # nearest rank: one of the steps' own times
            ordered = sorted(values)
            return ordered[max(0, math.ceil(len(ordered) * q) - 1)] if ordered else 0.0

        mixed_ms = [s.ms or 0.0 for s in mixed]

        return {
            "steps": len(timed),
            "with_prefill": len(mixed),
            "seconds": sum(s.ms or 0.0 for s in timed) / 1e3,
            "decode_rows": sum(s.decodes for s in timed),
            "prefill_tokens": sum(s.prefill_tokens for s in timed),
            "decode_ms": mean([s.ms or 0.0 for s in decode]),
            "mixed_ms": mean(mixed_ms),
            "mixed_p50_ms": quantile(mixed_ms, 0.5),
            "mixed_p90_ms": quantile(mixed_ms, 0.9),
            "mixed_max_ms": max(mixed_ms, default=0.0),
            "decodes_per_step": mean([float(s.decodes) for s in timed]),
            "prefill_tokens_per_mixed_step": mean([float(s.prefill_tokens) for s in mixed]),
        }


COLUMNS = (
    ("steps", "steps", 0),
    ("with_prefill", "with prefill", 0),
    ("seconds", "s", 2),
    ("decode_rows", "decode rows", 0),
    ("prefill_tokens", "prefill tokens", 0),
    ("decode_ms", "decode-only ms", 2),
    ("mixed_ms", "with-prefill ms", 2),
    ("mixed_p50_ms", "p50", 1),
    ("mixed_p90_ms", "p90", 1),
    ("mixed_max_ms", "max", 1),
    ("decodes_per_step", "rows/step", 1),
    ("prefill_tokens_per_mixed_step", "prefill tok/mixed step", 0),
)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", help="logs with the engine's debug-level step lines")
    ap.add_argument(
        "--between", default=None, help="only the steps between the first and last line matching this"
    )
    ap.add_argument(
        "--run", type=int, default=None, help="with --between: only the K-th run's steps (from 1)"
    )
    ap.add_argument("--idle-ms", type=float, default=None, help="a longer gap is idle time, not a step's")
    args = ap.parse_args(argv)
    rows = []
    for path in args.logs:
        with open(path, errors="replace") as f:
            rows.append(Timeline.parse(f.readlines(), args.between, args.run).summary(args.idle_ms))
    table = [["log"] + [c[1] for c in COLUMNS]]
    for path, row in zip(args.logs, rows):
        table.append([path.rsplit("/", 1)[-1]] + [f"{row[k]:.{nd}f}" for k, _, nd in COLUMNS])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(x.rjust(w) for x, w in zip(r, widths)))
    return rows


if __name__ == "__main__":
    main()
