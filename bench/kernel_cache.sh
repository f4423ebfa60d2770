#!/usr/bin/env bash
# Triton's compiled kernels from one GPU machine to the next: a fresh machine otherwise compiles
# every kernel again, out of the session's device time.
#
# On the GPU machine, at the end of a call (the parts come back from $OUT, under its limits):
#   bash bench/kernel_cache.sh save
# Here, after the call (.kcache/ is git-ignored; carry it beside .whl in later calls):
#   bash bench/kernel_cache.sh keep FILES_AT
# On the GPU machine, at the start of a later call:
#   bash bench/kernel_cache.sh load
# A kernel whose source or Triton changed is compiled again; the rest load from the cache.
set -euo pipefail
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
part_mb=15   # $OUT's files come back up to 16 MiB each
max_parts=3  # with the wheels, what a call carries stays under its 64 MiB
case "${1:-}" in
  save)
    [ -d "$cache" ] || { echo "no Triton cache at $cache" >&2; exit 0; }
    tmp=$(mktemp -d)
    tar -C "$cache" -czf - . | split -b "${part_mb}m" - "$tmp/kcache.tgz."
    n=$(find "$tmp" -name 'kcache.tgz.*' | wc -l)
    if [ "$n" -gt "$max_parts" ]; then
      echo "kernel cache: $n parts of ${part_mb} MB, over $max_parts: not saved" >&2
    else
      mv "$tmp"/kcache.tgz.* "${OUT:?}/"
      echo "kernel cache: $(du -sh "$cache" | cut -f1) in $n part(s) saved to \$OUT"
    fi
    rm -rf "$tmp"
    ;;
  keep)
    from=${2:?usage: bench/kernel_cache.sh keep FILES_AT}
    ls "$from"/kcache.tgz.* > /dev/null
    rm -rf .kcache && mkdir -p .kcache && cp "$from"/kcache.tgz.* .kcache/
    grep -qx '/.kcache/' .git/info/exclude 2> /dev/null || echo '/.kcache/' >> .git/info/exclude
    echo "kept $(du -sh .kcache | cut -f1) in .kcache; carry it"
    ;;
  load)
    [ -d .kcache ] || { echo "no .kcache here: nothing to load" >&2; exit 0; }
    mkdir -p "$cache"
    cat .kcache/kcache.tgz.* | tar -C "$cache" -xzf -
    echo "kernel cache: $(du -sh "$cache" | cut -f1) loaded into $cache"
    ;;
  *)
    echo "usage: bench/kernel_cache.sh save | keep FILES_AT | load" >&2
    exit 2
    ;;
esac
