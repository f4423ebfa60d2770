#!/usr/bin/env bash
# The wheels the GPU machine lacks, into ./.whl (carry it): ../shared/device/wheels.sh on this
# project's requirements less lm-eval (its sqlitedict has no wheel, so the whole resolution fails;
# the GPU machine runs no lm-eval test) and the linters, plus py-spy (serve_session.sh profile),
# and transformers 5.17.0, the oldest we take: the fetch leaves out what the image holds whatever
# its version, so a newer transformers met the image's older huggingface-hub (1.33; 5.25 needs 2.4)
# and failed at import.
#
#   bash bench/device_wheels.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
fetch=${WHEELS_SH:-$root/../shared/device/wheels.sh}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
grep -v -e 'lm-eval' -e '"ruff' -e '"mypy' "$root/pyproject.toml" > "$tmp/pyproject.toml"
(cd "$tmp" && bash "$fetch" py-spy transformers==5.17.0)
rm -rf "$root/.whl"
mv "$tmp/.whl" "$root/.whl"
rm -f "$root/.whl/needed.txt"
grep -qx '/.whl/' "$root/.git/info/exclude" 2> /dev/null || echo '/.whl/' >> "$root/.git/info/exclude"
echo "$(find "$root/.whl" -name '*.whl' | wc -l) wheels, $(du -sh "$root/.whl" | cut -f1) in .whl"
