#!/usr/bin/env bash
# Before and after in one run: the same benchmark from an earlier commit and from the working
# tree, back to back on the same GPU (the rule for performance changes: docs/performance.md, "Running
# the benchmarks").
#
# Here, before the device call (the export lands in .base/, which git ignores; carry it):
#   bash bench/ab.sh prepare REV
# On the GPU machine, from the repository root, after the wheels and `pip install -e .`:
#   bash bench/ab.sh run python3 -m bench.engine.decode --model configs/qwen3.5-9b --batch-sizes 1 8
# prints "=== before (REV)" and "=== after (working tree)" around the two runs' output.
set -euo pipefail
case "${1:-}" in
  prepare)
    rev=$(git rev-parse --short "${2:?usage: bench/ab.sh prepare REV}")
    rm -rf .base && mkdir -p .base
    git archive --prefix=base/ "$rev" | tar -x -C .base
    echo "$rev" > .base/REV
    grep -qx '/.base/' .git/info/exclude 2>/dev/null || echo '/.base/' >> .git/info/exclude
    echo "exported $rev to .base/base; carry .base"
    ;;
  run)
    shift
    [ -d .base/base ] || { echo "no .base/base: run 'bash bench/ab.sh prepare REV' here first" >&2; exit 2; }
    if [ ! -d /tmp/ab-base ]; then
      python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/ab-base .base/base
      # the benchmarks import `bench` and read `configs` from the working directory; the
      # package itself must come from the install, not from the export's source folders
      mkdir -p /tmp/ab-cwd && cp -r .base/base/bench .base/base/configs /tmp/ab-cwd/
      # a REV from before bench/ was split into folders (serving/, engine/, ops/) has its
      # benchmarks at bench/NAME.py: each also goes where the tree's command names it, so that
      # `-m bench.engine.decode` runs REV's own decode.py (whose `bench.NAME` imports find REV's)
      for f in bench/*/*.py; do
        old=/tmp/ab-cwd/bench/${f##*/}
        if [ "${f##*/}" != __init__.py ] && [ -f "$old" ] && [ ! -e "/tmp/ab-cwd/$f" ]; then
          mkdir -p "/tmp/ab-cwd/${f%/*}" && cp "$old" "/tmp/ab-cwd/$f"
        fi
      done
      # a benchmark newer than REV runs from the tree's copy (against REV's package)
      cp -rn bench/. /tmp/ab-cwd/bench/
    fi
    echo "=== before ($(cat .base/REV))"
    (cd /tmp/ab-cwd && PYTHONPATH="/tmp/ab-base${PYTHONPATH:+:$PYTHONPATH}" "$@") || echo "before: exit $?"
    echo "=== after (working tree)"
    "$@" || echo "after: exit $?"
    ;;
  *)
    echo "usage: bench/ab.sh prepare REV | bench/ab.sh run CMD..." >&2
    exit 2
    ;;
esac
