#!/usr/bin/env bash
# Serving runs on the GPU machine: start `deltaserve serve` with random weights, drive it with
# bench/serving/serve.py, stop it; then the same prompts through the offline engine. Everything lands in
# $OUT/serve.log (the tables) and $OUT/serve.tgz (each run's JSON and server log).
#
# On the GPU machine, from the repository root, after the wheels and `pip install -e .`:
#   bash bench/serve_session.sh PART
# PART: 9b | 08b | chat-ab | piecewise [CONFIG] | pinned [CONFIG] [C] | c1 [CONFIG] | 08b-outputs | dp | dp-chat | interval | moe [C] | 80b-fp8 | 80b-fp8-budget | budget [CONFIG] | 80b-fp8-offline | 80b-fp8-before | profile-80b-fp8 | ttft [CONFIG] | kimi [C] | moe-gemm-ab [CONFIG] [C] | chat | streams | delay [STEPS] | profile [CONFIG] | spread [CONFIG]
#   | timeline [CONFIG] [C] | cold-ab [CONFIG] [C]
#   | before / after [CONFIG] [C]: REV's server (`bash bench/ab.sh prepare REV` here; carry .base), the tree's
#     ($SERVER_ARGS: more server flags; $BENCH_ARGS: more bench.serving.serve flags; $TAG: a suffix to the run's name),
#     each after 64 concurrent warm-up requests: a fresh server's first mixed steps compile kernels,
#     which confounded the first such pair
#     (docs/history/performance-2026-12.md, "The HTTP process's cost per token")
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out/runs"
export PYTHONUNBUFFERED=1
log="$out/serve.log"
port=8000
WORKLOAD=(--input-len 1024 --output-len 256 --health-probe --client-processes 4)
# issue 24's row, after one wave of warm-up requests: a fresh machine's first waves of 8k prefills
# compile kernels, which slowed the first server of a pair
# (docs/history/performance-2026-12.md, "Decode batches of 17-32")
FP8_80B=(--input-len 8192 --output-len 1024 --health-probe --concurrency 32 --num-prompts 64 --warmup 32)

base_tree() {  # REV's package in /tmp/ab-base and its configs in /tmp/ab-cwd (bash bench/ab.sh prepare REV here)
  [ -d /tmp/ab-base ] || python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/ab-base .base/base
  mkdir -p /tmp/ab-cwd && cp -r .base/base/configs /tmp/ab-cwd/ && cp -r bench /tmp/ab-cwd/
}

listen_drops() {  # the kernel's count of connections a full accept queue dropped, and its limits
  awk '/^TcpExt:/ { if (!h) { split($0, k); h = 1 } else { split($0, v)
    for (i = 1; i <= NF; i++) if (k[i] ~ /^Listen/) printf "%s %s ", k[i], v[i] } }' /proc/net/netstat
  echo "somaxconn $(cat /proc/sys/net/core/somaxconn) syn_backlog $(cat /proc/sys/net/ipv4/tcp_max_syn_backlog)"
}

cpu_throttle() {  # the container's CPU quota and how often it has throttled us (cgroup v2): a cause of runs that give less
  local f=/sys/fs/cgroup
  [ -r $f/cpu.stat ] || return 0
  echo "cpu.max $(cat $f/cpu.max 2> /dev/null) $(awk '/throttled/ { printf "%s %s ", $1, $2 }' $f/cpu.stat)"
}

engine_sched() {  # where the engine process ran: its context switches and last CPU, beside the host's layout
  local pid
  pid=$(grep -ho "engine process pid [0-9]*" "$out/runs/$1.server.log" | tail -1 | awk '{ print $4 }')
  [ -n "$pid" ] && [ -r "/proc/$pid/status" ] || return 0
  echo "$1: engine pid $pid on CPU $(awk '{ print $39 }' "/proc/$pid/stat") of $(nproc)" \
    "($(lscpu 2> /dev/null | awk -F: '/^Thread\(s\) per core/ { gsub(/ /, "", $2); print $2 }') threads a core)," \
    "context switches: $(awk '/ctxt_switches/ { printf "%s %s ", $1, $2 }' "/proc/$pid/status")"
}

descendants() {  # a process and all its descendants' pids
  echo "$1"
  local c
  for c in $(ps -o pid= --ppid "$1"); do descendants "$c"; done
}

pin_engine() {  # pin_engine NAME SERVER_PID: the engine process alone on the first $PIN physical cores
  # (their hyperthreads too), the HTTP processes and the clients on the rest: is a host-bound engine
  # loop slowed by the processes beside it?
  local name=$1 server=$2 engine eng rest p
  engine=$(grep -ho "engine process pid [0-9]*" "$out/runs/$name.server.log" | tail -1 | awk '{ print $4 }')
  eng=$(lscpu -p=CPU,CORE | grep -v '^#' | awk -F, -v n="$PIN" '{ if (!($2 in k)) k[$2] = ++m; if (k[$2] <= n) print $1 }' | paste -sd,)
  rest=$(lscpu -p=CPU | grep -v '^#' | grep -vxF -f <(tr , '\n' <<< "$eng") | paste -sd,)
  echo "$rest" > "$out/rest_cpus"
  for p in $(descendants "$server"); do taskset -a -p -c "$rest" "$p" > /dev/null; done
  taskset -a -p -c "$eng" "$engine" > /dev/null
  echo "$name: engine $engine on CPUs $eng; the server's other processes and the clients on $rest"
}

serve_bench() {  # serve_bench NAME CWD PYTHONPATH "SERVER ARGS" BENCH ARGS... ($BENCH: the load's module)
  local name=$1 cwd=$2 pypath=$3 sargs=$4
  shift 4
  echo "=== $name: serve $sargs | bench $*" | tee -a "$log"
  # shellcheck disable=SC2086
  (cd "$cwd" && PYTHONPATH="$pypath" exec python3 -m deltaserve serve --port $port $sargs) \
    > "$out/runs/$name.server.log" 2>&1 &
  local pid=$! t0=$SECONDS
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    if ! kill -0 $pid 2> /dev/null || [ $((SECONDS - t0)) -gt 400 ]; then
      echo "$name: server did not come up" | tee -a "$log"
      tail -20 "$out/runs/$name.server.log" | tee -a "$log"
      kill $pid 2> /dev/null
      return
    fi
    sleep 1
  done
  touch "$out/runs/$name.up"  # what Triton compiles after this, it compiles while serving (cold-ab)
  echo "$name: up in $((SECONDS - t0)) s; before: $(listen_drops) $(cpu_throttle)" | tee -a "$log"
  local clients=()
  if [ -n "${PIN:-}" ]; then
    pin_engine "$name" "$pid" | tee -a "$log"
    clients=(taskset -c "$(cat "$out/rest_cpus")")
  fi
  timeout 500 "${clients[@]}" python3 -m "${BENCH:-bench.serving.serve}" --base-url "http://127.0.0.1:$port" "$@" \
    --output-json "$out/runs/$name.json" 2>&1 | tee -a "$log"
  echo "$name: after: $(listen_drops) $(cpu_throttle)" | tee -a "$log"
  engine_sched "$name" | tee -a "$log"
  kill -TERM $pid
  wait $pid
  echo "$name: server exit $?" | tee -a "$log"
}

offline() {  # offline NAME CONFIG ARGS_JSON BENCH ARGS...
  local name=$1 model=$2 args=$3
  shift 3
  echo "=== $name: offline $model $args | $*" | tee -a "$log"
  timeout 500 python3 -m bench.serving.serve --offline-only --offline-model "$model" --offline-args "$args" "$@" \
    --output-json "$out/runs/$name.json" 2>&1 | grep -v "it/s\]" | tee -a "$log"
  echo "$name: after: $(cpu_throttle)" | tee -a "$log"
}

# the built-in model's Qwen3 tokenizer: streams then carry text, detokenized as users' would be
tok=$(python3 -c "from deltaserve.models.checkpoints.builtin import builtin_model_path; print(builtin_model_path())")
dummy="--load-format dummy --tokenizer $tok"

cpu_s() {  # a process's user+system CPU seconds, all threads
  awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / hz }' "/proc/$1/stat"
}

profile_load() {  # profile_load NAME SECONDS BENCH ARGS...: py-spy both processes under a load
  local name=$1 secs=$2
  shift 2
  python3 -m bench.serving.serve --base-url "http://127.0.0.1:$port" "$@" --output-json "$out/runs/$name.json" \
    > "$out/runs/$name.log" 2>&1 &
  local bench=$!
  sleep "${PROFILE_DELAY:-8}"  # seconds of load before py-spy starts
  local server engine  # process 0 and the engine, whose pids the server logs at start-up
  server=$(pgrep -f "deltaserve serve --port $port" | head -1)
  engine=$(grep -ho "engine process pid [0-9]*" "$out"/runs/profile-*.server.log | tail -1 | awk '{ print $4 }')
  local cpu0 cpu1
  cpu0="$(cpu_s "$engine") $(cpu_s "$server")"
  # the GPU's busy fraction beside it: a loop that looks host-bound may be waiting in launches
  timeout "$secs" nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 \
    > "$out/runs/$name.gpu-util.txt" 2> /dev/null &
  # the engine's idle samples too: where its loop sleeps, not only where it works
  py-spy record --nonblocking --idle -r 100 -d "$secs" -f raw -p "$engine" -o "$out/runs/$name.engine.txt" > /dev/null 2>&1 &
  py-spy record --nonblocking -r 100 -d "$secs" -f raw -p "$server" -o "$out/runs/$name.http.txt" > /dev/null 2>&1
  cpu1="$(cpu_s "$engine") $(cpu_s "$server")"
  echo "$name: CPU seconds over ${secs} s (engine, http): $cpu0 -> $cpu1" | tee -a "$log"
  awk '{ n++; s += $1; if ($1 >= 90) b++ } END { if (n) printf "%s: GPU utilization mean %.0f%%, >= 90%% in %d of %d samples\n", name, s / n, b, n }' \
    name="$name" "$out/runs/$name.gpu-util.txt" | tee -a "$log"
  wait $bench
  tail -22 "$out/runs/$name.log" | tee -a "$log"
  python3 -m bench.pyspy_summary "$out/runs/$name.engine.txt" --within EngineCore.run --rows 30 | tee -a "$log"
  python3 -m bench.pyspy_summary "$out/runs/$name.http.txt" --rows 20 | tee -a "$log"
}
case "${1:-9b}" in
  9b)
    serve_bench 9b-new . "${PYTHONPATH:-}" "--model configs/qwen3.5-9b $dummy" \
      "${WORKLOAD[@]}" --concurrency 1,64,256 --warmup 64
    offline 9b-offline configs/qwen3.5-9b '{"load_format": "dummy"}' "${WORKLOAD[@]}" --concurrency 1,64,256 --warmup 64
    ;;
  before)  # before [CONFIG] [CONCURRENCY]: REV's server (default 9B at 64,256); BEFORE_PATH: its site-packages
    base_tree
    cfg=${2:-qwen3.5-9b}
    serve_bench "${cfg##*/}-before${TAG:-}" /tmp/ab-cwd "/tmp/ab-base:${BEFORE_PATH:-${PYTHONPATH:-}}" \
      "--model configs/$cfg $dummy ${SERVER_ARGS:-}" "${WORKLOAD[@]}" --concurrency "${3:-64,256}" --warmup 64 ${BENCH_ARGS:-}
    ;;
  after)  # after [CONFIG] [CONCURRENCY]: the tree's server, as `before` runs REV's
    cfg=${2:-qwen3.5-9b}
    serve_bench "${cfg##*/}-after${TAG:-}" . "${PYTHONPATH:-}" "--model configs/$cfg $dummy ${SERVER_ARGS:-}" \
      "${WORKLOAD[@]}" --concurrency "${3:-64,256}" --warmup 64 ${BENCH_ARGS:-}
    ;;
  profile)  # profile [CONFIG]: py-spy at C = 64 and 256 ($SERVER_ARGS: more server flags)
    if ! command -v py-spy > /dev/null; then  # pip --target skips bin/ on a machine that has /tmp/site already
      python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl/py_spy*.whl
      export PATH=/tmp/spy/bin:$PATH
    fi
    cfg=${2:-qwen3.5-9b}
    name=${cfg##*/}
    # shellcheck disable=SC2086
    (exec python3 -m deltaserve serve --port $port --model "configs/$cfg" $dummy ${SERVER_ARGS:-}) \
      > "$out/runs/profile-$name.server.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; done
    profile_load "$name-c64-prof" 6 "${WORKLOAD[@]}" --concurrency 64 --num-prompts 256
    profile_load "$name-c256-prof" 8 "${WORKLOAD[@]}" --concurrency 256 --num-prompts 768
    kill -TERM $pid
    wait $pid
    ;;
  profile-80b-fp8)  # py-spy of the 80B FP8 server through its first wave's 8k prefills (issue 24's workload)
    if ! command -v py-spy > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl/py_spy*.whl
      export PATH=/tmp/spy/bin:$PATH
    fi
    (exec python3 -m deltaserve serve --port $port --model configs/qwen3-next-80b-a3b-fp8 $dummy) \
      > "$out/runs/profile-80b-fp8.server.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; done
    # a fresh machine's first prefills compile kernels: not what the profile is for
    python3 -m bench.serving.serve --base-url "http://127.0.0.1:$port" --input-len 8192 --output-len 16 \
      --concurrency 8 --num-prompts 8 > "$out/runs/profile-80b-fp8.warmup.log" 2>&1
    PROFILE_DELAY=3 profile_load 80b-fp8-prefill-prof 12 --input-len 8192 --output-len 1024 --concurrency 32 \
      --num-prompts 32
    kill -TERM $pid
    wait $pid
    ;;
  08b)
    serve_bench 08b-new . "${PYTHONPATH:-}" "--model configs/qwen3.5-0.8b $dummy" \
      "${WORKLOAD[@]}" --concurrency 1,64,256 --warmup 64
    offline 08b-offline configs/qwen3.5-0.8b '{"load_format": "dummy"}' "${WORKLOAD[@]}" --concurrency 1,64,256 --warmup 64
    ;;
  piecewise)  # piecewise [CONFIG]: steps with prefill eager, then in pieces replayed (default 0.8B; $MODES: the order)
    cfg=${2:-qwen3.5-0.8b}
    for mode in ${MODES:-eager pieces}; do
      flag=""
      [ "${mode%2}" = pieces ] && flag="--enable-piecewise-cuda-graph"
      serve_bench "$cfg-$mode" . "${PYTHONPATH:-}" "--model configs/$cfg $dummy $flag" \
        "${WORKLOAD[@]}" --concurrency 1,64,256 --warmup 64
    done
    ;;
  08b-outputs)  # the offline 0.8B engine asking for final outputs, then for streams' per-step outputs, twice each
    for kind in final streams final streams; do
      offline "08b-offline-$kind" configs/qwen3.5-0.8b '{"load_format": "dummy"}' "${WORKLOAD[@]}" \
        --concurrency 64,256 --warmup 64 --offline-outputs "$kind"
    done
    ;;
  interval)  # the 0.8B server at C = 64 and 256 with --stream-interval 1 then 4, twice
    for n in 1 4 1 4; do
      serve_bench "08b-interval-$n" . "${PYTHONPATH:-}" "--model configs/qwen3.5-0.8b $dummy --stream-interval $n" \
        "${WORKLOAD[@]}" --concurrency 64,256 --warmup 64
    done
    ;;
  moe)  # moe [C,...]: Qwen3.5-35B-A3B (default C = 1,64,256)
    serve_bench 35b-new . "${PYTHONPATH:-}" "--model configs/qwen3.5-35b-a3b $dummy" \
      "${WORKLOAD[@]}" --concurrency "${2:-1,64,256}" --warmup 64
    ;;
  chat)  # multi-turn chat sessions with retries, radix against naive (bench/serving/chat_sessions.py)
    CHAT=(--sessions 64 --concurrency 32 --turns 4 --system-words 1000 --user-words 100 --max-tokens 256)
    BENCH=bench.serving.chat_sessions serve_bench chat-9b-radix . "${PYTHONPATH:-}" "--model configs/qwen3.5-9b $dummy" "${CHAT[@]}"
    BENCH=bench.serving.chat_sessions serve_bench chat-9b-naive . "${PYTHONPATH:-}" \
      "--model configs/qwen3.5-9b $dummy --cache-type naive" "${CHAT[@]}"
    ;;
  chat-ab)  # the chat sessions above against a radix server of REV (bash bench/ab.sh prepare REV; carry .base), then the tree's
    CHAT=(--sessions 64 --concurrency 32 --turns 4 --system-words 1000 --user-words 100 --max-tokens 256)
    base_tree
    BENCH=bench.serving.chat_sessions serve_bench chat-9b-before /tmp/ab-cwd "/tmp/ab-base:${PYTHONPATH:-}" \
      "--model configs/qwen3.5-9b $dummy" "${CHAT[@]}"
    BENCH=bench.serving.chat_sessions serve_bench chat-9b-after . "${PYTHONPATH:-}" "--model configs/qwen3.5-9b $dummy" "${CHAT[@]}"
    ;;
  dp)  # two GPUs: --data-parallel-size 2 for 9B and 0.8B at C = 64, 256 (one GPU's rows: 9b, 08b)
    for model in qwen3.5-9b qwen3.5-0.8b; do
      serve_bench "$model-dp2" . "${PYTHONPATH:-}" "--model configs/$model $dummy --data-parallel-size 2" \
        "${WORKLOAD[@]}" --concurrency 64,256 --warmup 64
    done
    ;;
  dp-chat)  # two GPUs: chat sessions over --data-parallel-size 2, cache-aware routing against round robin
    CHAT=(--sessions 64 --concurrency 32 --turns 4 --system-words 1000 --user-words 100 --max-tokens 256)
    for method in cache_aware round_robin; do
      BENCH=bench.serving.chat_sessions serve_bench "chat-9b-dp2-$method" . "${PYTHONPATH:-}" \
        "--model configs/qwen3.5-9b $dummy --data-parallel-size 2 --load-balance-method $method" "${CHAT[@]}"
    done
    ;;
  delay)  # delay [STEPS]: --max-prefill-delay-steps 0 against STEPS (default 8), 0.8B and 9B
    for d in 0 "${2:-8}"; do
      serve_bench "08b-delay$d" . "${PYTHONPATH:-}" "--model configs/qwen3.5-0.8b $dummy --max-prefill-delay-steps $d" \
        "${WORKLOAD[@]}" --concurrency 64,256
    done
    for d in 0 "${2:-8}"; do
      serve_bench "9b-delay$d" . "${PYTHONPATH:-}" "--model configs/qwen3.5-9b $dummy --max-prefill-delay-steps $d" \
        "${WORKLOAD[@]}" --concurrency 64,256
    done
    ;;
  streams)  # issue 18's failure check: 1,024 concurrent streams, with and without keep-alive (0.8B, short outputs)
    serve_bench 08b-1024 . "${PYTHONPATH:-}" "--model configs/qwen3.5-0.8b $dummy" \
      --input-len 1024 --output-len 64 --health-probe --concurrency 1024 --num-prompts 2048
    serve_bench 08b-1024-close . "${PYTHONPATH:-}" "--model configs/qwen3.5-0.8b $dummy" \
      --input-len 1024 --output-len 64 --health-probe --concurrency 1024 --num-prompts 2048 --no-keepalive
    ;;
  ttft)  # ttft [CONFIG]: C = 1 with each engine step in the log, server then offline, to compare their timelines
    cfg=${2:-qwen3.5-0.8b}
    serve_bench "$cfg-ttft" . "${PYTHONPATH:-}" "--model configs/$cfg $dummy --log-level debug" \
      "${WORKLOAD[@]}" --concurrency 1 --num-prompts 4
    grep -E "step:|tok/s" "$out/runs/$cfg-ttft.server.log" | tail -40 | tee -a "$log"
    python3 -m bench.serving.serve --offline-only --offline-model "configs/$cfg" --offline-args '{"load_format": "dummy"}' \
      "${WORKLOAD[@]}" --concurrency 1 --num-prompts 4 --log-level debug > "$out/runs/$cfg-ttft-offline.log" 2>&1
    grep -E "step:|tok/s|TTFT" "$out/runs/$cfg-ttft-offline.log" | tail -40 | tee -a "$log"
    ;;
  c1)  # c1 [CONFIG]: C = 1, decode steps of the offline engine (final outputs, then streams' outputs) and the server, py-spy of each
    cfg=${2:-qwen3.5-0.8b}
    if ! command -v py-spy > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/spy .whl/py_spy*.whl
      export PATH=/tmp/spy/bin:$PATH
    fi
    c1=(--input-len 1024 --output-len 256 --concurrency 1 --num-prompts 8 --log-level debug)
    decode_ms() {  # the median of a log's decode-only steps of one request (ms since the step before)
      grep "step: 1 decodes, 0 verifications, 0 prefill" "$1" | sed 's/.*; \([0-9.]*\) ms.*/\1/' | sort -n \
        | awk '{ a[NR] = $1 } END { printf "decode step median %s ms, p90 %s ms over %d\n", a[int(NR / 2)], a[int(NR * 0.9)], NR }'
    }
    for kind in final streams; do
      py-spy record --nonblocking --idle -r 200 -f raw -o "$out/runs/c1-offline-$kind.spy.txt" -- python3 -m bench.serving.serve --offline-only \
        --offline-model "configs/$cfg" --offline-args '{"load_format": "dummy", "max_running_requests": 256}' \
        --offline-outputs "$kind" "${c1[@]}" > "$out/runs/c1-offline-$kind.log" 2>&1
      echo "offline $kind: $(grep -h "^offline c=1: [0-9]" "$out/runs/c1-offline-$kind.log"); $(decode_ms "$out/runs/c1-offline-$kind.log")" | tee -a "$log"
      python3 -m bench.pyspy_summary "$out/runs/c1-offline-$kind.spy.txt" --within _drive --rows 30 | tee -a "$log"
    done
    (exec python3 -m deltaserve serve --port $port --model "configs/$cfg" $dummy --log-level debug) > "$out/runs/c1.server.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; done
    python3 -m bench.serving.serve --base-url "http://127.0.0.1:$port" "${c1[@]}" --warmup 2 --num-prompts 16 \
      --output-json "$out/runs/c1.json" > "$out/runs/c1.log" 2>&1 &
    bench=$!
    sleep 6
    engine=$(grep -ho "engine process pid [0-9]*" "$out/runs/c1.server.log" | tail -1 | awk '{ print $4 }')
    py-spy record --nonblocking --idle -r 200 -d 3 -f raw -p "$engine" -o "$out/runs/c1.engine.spy.txt" > /dev/null 2>&1
    wait $bench
    kill -TERM $pid
    wait $pid
    grep -E "out tok/s|^ *c=1 " "$out/runs/c1.log" | tee -a "$log"
    echo "server: $(decode_ms "$out/runs/c1.server.log")" | tee -a "$log"
    python3 -m bench.pyspy_summary "$out/runs/c1.engine.spy.txt" --within EngineCore.run --rows 30 | tee -a "$log"
    ;;
  cold-ab)  # cold-ab [CONFIG] [C]: REV's server then the tree's, each from an empty Triton cache, with the steps
    # slower than 300 ms and the kernels Triton compiled after start-up (bash bench/ab.sh prepare REV; carry .base);
    # $SIDES: "before" or "after" alone, for two calls on one warm machine when both exceed a call's limit
    base_tree
    cfg=${2:-../bench/configs/kimi-linear-48b-a3b-12l}
    cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
    for side in ${SIDES:-before after}; do
      rm -rf "$cache"
      name="${cfg##*/}-cold-$side"
      if [ $side = before ]; then cwd=/tmp/ab-cwd pypath="/tmp/ab-base:${PYTHONPATH:-}"; else cwd=. pypath="${PYTHONPATH:-}"; fi
      serve_bench "$name" "$cwd" "$pypath" "--model configs/$cfg $dummy --log-level debug ${SERVER_ARGS:-}" \
        "${WORKLOAD[@]}" --concurrency "${3:-256}" --warmup 64
      python3 -m bench.serving.step_timeline "$out/runs/$name.server.log" --between 'GET /metrics' | tee -a "$log"
      echo "$name: steps over 300 ms while serving: $(sed -n '/GET \/metrics/,$p' "$out/runs/$name.server.log" \
        | grep -oE '[0-9.]+ ms since the last' | awk '$1 > 300 { printf "%s ", $1 }')" | tee -a "$log"
      echo "$name: compiled after start-up: $(find "$cache" -newer "$out/runs/$name.up" -name '*.json' ! -name '__grp__*' \
        -printf '%f ' 2> /dev/null)" | tee -a "$log"
      # each one's signature: which arguments Triton specialized (tt.divisibility) tells what made it new
      find "$cache" -newer "$out/runs/$name.up" -name '*.ttir' -exec grep -m1 -H 'tt.func' {} \; \
        > "$out/runs/$name.compiled.txt" 2> /dev/null
    done
    ;;
  timeline)  # timeline [CONFIG] [C,...]: the engine's steps (bench/serving/step_timeline.py), server against offline, per C
    # ($SERVER_ARGS: more server flags; $OFFLINE_ARGS: the offline engine's JSON, to match them)
    cfg=${2:-qwen3.5-0.8b}
    c=${3:-256}
    name=${cfg##*/}
    dummy_json='{"load_format": "dummy"}'
    serve_bench "$name-timeline" . "${PYTHONPATH:-}" "--model configs/$cfg $dummy --log-level debug ${SERVER_ARGS:-}" \
      "${WORKLOAD[@]}" --concurrency "$c" --warmup 64
    python3 -m bench.serving.serve --offline-only --offline-model "configs/$cfg" --offline-args "${OFFLINE_ARGS:-$dummy_json}" \
      "${WORKLOAD[@]}" --concurrency "$c" --warmup 64 --log-level debug > "$out/runs/$name-timeline-offline.log" 2>&1
    grep "^offline" "$out/runs/$name-timeline-offline.log" | tee -a "$log"
    IFS=, read -ra cs <<< "$c"
    for k in "${!cs[@]}"; do  # one table per run
      echo "c=${cs[$k]}:" | tee -a "$log"
      python3 -m bench.serving.step_timeline "$out/runs/$name-timeline.server.log" "$out/runs/$name-timeline-offline.log" \
        --between 'GET /metrics|^offline c=' --run $((k + 1)) | tee -a "$log"
    done
    ;;
  pinned)  # pinned [CONFIG] [C]: servers with the engine free and pinned alone to $PIN_CORES cores (default 2), alternated $ROUNDS times (default 2)
    cfg=${2:-qwen3.5-0.8b}
    { lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|Model name|NUMA node)"; nproc; } | tee -a "$log"
    for round in $(seq "${ROUNDS:-2}"); do
      serve_bench "$cfg-free$round" . "${PYTHONPATH:-}" "--model configs/$cfg $dummy" "${WORKLOAD[@]}" \
        --concurrency "${3:-64,256}" --warmup 64
      PIN=${PIN_CORES:-2} serve_bench "$cfg-pinned$round" . "${PYTHONPATH:-}" "--model configs/$cfg $dummy" \
        "${WORKLOAD[@]}" --concurrency "${3:-64,256}" --warmup 64
    done
    ;;
  spread)  # spread [CONFIG]: server then offline, twice, at C = 64 and 256: how far one build moves within a call
    cfg=${2:-qwen3.5-0.8b}
    for round in 1 2; do
      serve_bench "$cfg-spread$round" . "${PYTHONPATH:-}" "--model configs/$cfg $dummy" "${WORKLOAD[@]}" \
        --concurrency 64,256 --warmup 64
      offline "$cfg-spread$round-offline" "configs/$cfg" '{"load_format": "dummy"}' "${WORKLOAD[@]}" \
        --concurrency 64,256 --warmup 64
    done
    ;;
  80b-fp8)  # issue 24's serving row: Qwen3-Next-80B-A3B FP8, 8k in / 1k out, 32 clients
    serve_bench 80b-fp8 . "${PYTHONPATH:-}" "--model configs/qwen3-next-80b-a3b-fp8 $dummy" "${FP8_80B[@]}"
    ;;
  80b-fp8-budget)  # issue 24's row at step budgets of 8,192 (the default) and 16,384 tokens (SGLang's on H200-class GPUs; $BUDGETS: which; $SERVER_ARGS, $TAG as for after)
    for budget in ${BUDGETS:-8192 16384}; do
      serve_bench "80b-fp8-budget$budget${TAG:-}" . "${PYTHONPATH:-}" \
        "--model configs/qwen3-next-80b-a3b-fp8 $dummy --max-num-batched-tokens $budget ${SERVER_ARGS:-}" "${FP8_80B[@]}"
    done
    ;;
  budget)  # budget [CONFIG]: issue 18's workload at C = 64, 256 with step budgets of 8,192 and 16,384 tokens (default 9B)
    for budget in 8192 16384; do
      serve_bench "budget$budget-${2:-qwen3.5-9b}" . "${PYTHONPATH:-}" \
        "--model configs/${2:-qwen3.5-9b} $dummy --max-num-batched-tokens $budget" \
        "${WORKLOAD[@]}" --concurrency 64,256 --warmup 64
    done
    ;;
  80b-fp8-offline)  # the same requests through the offline engine, for the server/offline ratio
    offline 80b-fp8-offline configs/qwen3-next-80b-a3b-fp8 '{"load_format": "dummy"}' "${FP8_80B[@]}"
    ;;
  80b-fp8-before)  # the same row on REV's server (bash bench/ab.sh prepare REV here; carry .base)
    base_tree
    serve_bench 80b-fp8-before /tmp/ab-cwd "/tmp/ab-base:${PYTHONPATH:-}" \
      "--model configs/qwen3-next-80b-a3b-fp8 $dummy" "${FP8_80B[@]}"
    ;;
  moe-gemm-ab)  # moe-gemm-ab [CONFIG] [C,...]: a server with DELTASERVE_MOE_GEMM=triton, then one with auto (default C = 256)
    for mode in triton auto; do
      DELTASERVE_MOE_GEMM=$mode serve_bench "moe-$mode" . "${PYTHONPATH:-}" "--model ${2:-configs/qwen3.5-35b-a3b} $dummy" \
        "${WORKLOAD[@]}" --concurrency "${3:-256}" --warmup 64
    done
    ;;
  kimi)  # kimi [C,...]: Kimi-Linear-48B-A3B (default C = 1,64,256; one level a call fits a call's limit)
    serve_bench kimi-new . "${PYTHONPATH:-}" "--model configs/kimi-linear-48b-a3b $dummy" \
      "${WORKLOAD[@]}" --concurrency "${2:-1,64,256}" --warmup 64
    ;;
  *)
    echo "unknown part $1" >&2
    exit 2
    ;;
esac
tar -czf "$out/serve.tgz" -C "$out" runs
