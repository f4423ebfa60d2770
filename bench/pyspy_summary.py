"""Where a py-spy profile's time goes: a raw profile (`py-spy record -f raw`) summed by function,
own time and cumulative, over the samples whose stack passes through `--within` (for example
the timed loop of a benchmark, leaving out its start-up).

    py-spy record -r 200 -f raw -o prof.txt -- python -m bench.engine.prefill_steps ...
    python -m bench.pyspy_summary prof.txt --within timed_prompts --lines jit.py,autotuner.py

`--lines` keeps the line numbers of the files named, so that time in one function splits by
line (in Triton's `JITFunction.run`, the binder apart from the C launcher's call).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def frame_name(frame: str, keep_lines: tuple[str, ...]) -> str:
    """`func (file)`, with `:line` kept where the file's name ends with one of `keep_lines`."""
    m = _FRAME.match(frame.strip())
    if m is None:
        return frame.strip()
    file = m["file"]
    short = "/".join(file.split("/")[-2:])
    if m["line"] and any(file.endswith(k) for k in keep_lines):
        return f"{m['func']} ({short}:{m['line']})"
    return f"{m['func']} ({short})"


def summarize(
    lines: list[str], within: str | None, keep_lines: tuple[str, ...]
) -> tuple[int, Counter[str], Counter[str]]:
    """(samples, own samples by frame, cumulative samples by frame) of the stacks through `within`."""
    total = 0
    own: Counter[str] = Counter()
    cumulative: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if within is not None:
            idx = next((i for i, f in enumerate(frames) if within in f), None)
            if idx is None:
                continue
            frames = frames[idx:]
        n = int(count)
        total += n
        names = [frame_name(f, keep_lines) for f in frames]
        own[names[-1]] += n
        for name in set(names):
            cumulative[name] += n
    return total, own, cumulative


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--within", help="only stacks through a frame containing this text")
    ap.add_argument("--lines", default="", help="comma-separated file names whose line numbers are kept")
    ap.add_argument("--rows", type=int, default=40)
    args = ap.parse_args()
    with open(args.profile) as f:
        lines = f.readlines()
    keep = tuple(k for k in args.lines.split(",") if k)
    total, own, cumulative = summarize(lines, args.within, keep)
    print(f"{total} samples" + (f" through {args.within!r}" if args.within else ""))
    for title, counts in (("own", own), ("cumulative", cumulative)):
        print(f"\n{title}:")
        for name, n in counts.most_common(args.rows):
            print(f"{100 * n / max(total, 1):6.1f}%  {name}")


if __name__ == "__main__":
    main()
