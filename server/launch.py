"""`deltaserve serve`: load the engine, log what was loaded, run the HTTP server until SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import stat
import sys
from typing import Any

logger = logging.getLogger("deltaserve")


def serve(args: argparse.Namespace) -> int:
    # Read here rather than as the flag's default, so that --help never prints the key.
    args.api_key = args.api_key or os.environ.get("DELTASERVE_API_KEY") or None
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.headless or args.node_rank > 0:
        return _serve_headless(args)
    from .draining import FLUSH_S

    config = _uvicorn_config(args)
    _check_tls(args)  # as a taken port below: a bad key fails now, not after minutes of loading
    sock = _bind(config)
    if not args.uds:
        args.port = sock.getsockname()[1]  # --port 0: the one the system picked, in the log line below
    _raise_open_files_limit()
    _warn_if_accept_queue_capped(config.backlog)
    engine_config = _engine_config(args)
    sampling_defaults = _sampling_defaults(args, engine_config.model)
    if args.api_server_count is None:
        from .api_servers import default_api_server_count, usable_cores

        args.api_server_count = default_api_server_count(
            str(engine_config.device), usable_cores(), engine_config.data_parallel_size
        )
    count = args.api_server_count
    # a SIGTERM or Ctrl-C while the engines load (minutes, for a large model) stops them and
    # their tensor-parallel ranks, which ignore both signals and would otherwise load on
    # orphaned (or, behind Python's exit joining them, forever)
    starting = _Starting()
    handles: list[Any] = []
    others = None
    try:
        _start_engines(
            engine_config,
            args.log_level,
            0.0 if args.disable_log_stats else args.log_stats_interval,
            count,
            started=handles,
        )
        server, others = _start_http(args, engine_config, sampling_defaults, handles, sock, count, starting)
    except _Interrupted as stop:
        logger.info("%s while starting: stopping", signal.Signals(stop.sig).name)
        for handle in handles:
            handle.close()  # kills the engine process; its ranks end with it
        signal.signal(stop.sig, signal.SIG_DFL)
        os.kill(os.getpid(), stop.sig)  # ended by the signal, as before the engines were started
        raise SystemExit(128 + stop.sig) from None
    starting.done()
    try:
        server.run(sockets=[sock])
    finally:
        if others is not None:
            others.stop(float(args.shutdown_timeout) + FLUSH_S + 5)
        for handle in handles:
            if handle.alive():  # the app's shutdown normally stops it; not when start-up failed
                handle.stop()
        if args.uds:
            with contextlib.suppress(OSError):
                os.unlink(args.uds)
    if not server.started:
        raise SystemExit(1)
    if others is not None and others.lost is not None:
        logger.error("stopped because %s", others.lost)
        return 1  # a supervisor restarts a server that lost a part of itself
    logger.info("shut down cleanly")
    return 0


class _Interrupted(BaseException):  # as KeyboardInterrupt: start-up code's `except Exception` lets it through
    def __init__(self, sig: int) -> None:
        super().__init__(sig)
        self.sig = sig


class _Starting:
    """SIGTERM and SIGINT raise `_Interrupted` until `done` (the server then runs, and drains on
    them); `install` puts the handlers back over those `http_server` sets."""

    def __init__(self) -> None:
        self.active = True
        self.install()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, sig: int, _frame: Any) -> None:
        if self.active:
            raise _Interrupted(sig)
        # uvicorn re-raises the signal that stopped it once it has drained: nothing more to do

    def done(self) -> None:
        self.active = False


def _start_http(
    args: argparse.Namespace,
    engine_config: Any,
    sampling_defaults: Any,
    handles: list[Any],
    sock: Any,
    count: int,
    starting: _Starting,
) -> tuple[Any, Any]:
    """Process 0's HTTP server and the other HTTP processes, ready (not yet serving); the
    others are killed when `starting` is interrupted meanwhile."""
    model_dir, tokenizer = str(engine_config.model), str(engine_config.tokenizer or engine_config.model)
    if len(handles) > 1:  # the routing table and load every HTTP process maps, made before any opens them
        from .engine_router import SharedLoad, SharedRoutes, load_path, routes_path

        SharedRoutes(routes_path(handles[0].ipc_dir), create=True)
        SharedLoad(load_path(handles[0].ipc_dir), 0, count, len(handles), create=True)
    others = None
    try:
        if count > 1:
            from .api_servers import ApiServers

            others = ApiServers.start(args, sock, handles, model_dir, tokenizer)
        server = http_server(
            args,
            handles,
            sampling_defaults,
            tokenizer,
            shared=_shared_metrics(handles[0], count),
            peers=others,
        )
        starting.install()  # over the handlers http_server set, until the server runs
        _log_engine(server.client)
        if others is not None:
            others.wait_ready()
            others.watch(lambda: server.handle_exit(signal.SIGTERM, None))  # one gone: the server stops
            logger.info(
                "%d HTTP processes share the port (pids %s)",
                count,
                ", ".join(map(str, others.pids(os.getpid()))),
            )
    except _Interrupted:
        for process in others.processes if others is not None else []:
            process.kill()
        raise
    pids = ", ".join(str(h.process.pid if h.process is not None else "?") for h in handles)
    logger.info("engine process%s pid %s", "es (data parallel)" if len(handles) > 1 else "", pids)
    names, aliases = _served_names(args)
    logger.info(
        "serving %s on %s%s (API key %s)",
        ", ".join(names + [f"{a} (alias)" for a in aliases]),
        f"unix:{args.uds}"
        if args.uds
        else f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}",
        args.root_path,
        "required" if args.api_key else "not required",
    )
    return server, others


def http_server(
    args: argparse.Namespace,
    handles: list[Any],
    sampling_defaults: Any,
    tokenizer: str,
    *,
    shared: Any = None,
    peers: Any = None,
    ignore_sigint: bool = False,
) -> Any:
    """One HTTP process's uvicorn server (a DrainingServer, not yet run) over the engine of
    `handles` (one EngineHandle for each data-parallel engine): the app, its EngineClient and
    Metrics. Its signal handlers make a SIGTERM'd server exit 0
    after its drain."""
    from deltaserve.engine.gc_heap import freeze_startup_heap
    from deltaserve.models.checkpoints.loader import load_tokenizer

    from .app import Cors, build_app
    from .draining import DrainingServer
    from .engine_client import EngineClient
    from .metrics import Metrics
    from .text.chat_template import load_chat_template

    config = _uvicorn_config(args)
    names, aliases = _served_names(args)
    routes = load = None
    if len(handles) > 1:
        from .engine_router import SharedLoad, SharedRoutes, load_path, routes_path

        routes = SharedRoutes(routes_path(handles[0].ipc_dir))
        if shared is not None:  # several HTTP processes: each counts its requests in its own row
            load = SharedLoad(load_path(handles[0].ipc_dir), shared.index, shared.count, len(handles))
    client = EngineClient(
        handles,
        None if getattr(args, "skip_tokenizer_init", False) else load_tokenizer(tokenizer),
        Metrics(names[0]),
        getattr(args, "load_balance_method", "cache_aware"),
        routes,
        load,
    )
    config.app = build_app(
        client,
        model_names=names,
        model_aliases=aliases,
        chat_template=load_chat_template(args.chat_template),
        api_key=args.api_key,
        sampling_defaults=sampling_defaults,
        max_body_bytes=int(args.max_request_body_mb * 2**20),
        shared_metrics=shared,
        cors=Cors(  # unset: any, as vLLM and SGLang allow ([] turns CORS off)
            _any_if_unset(args.allowed_origins),
            _any_if_unset(args.allowed_methods),
            _any_if_unset(args.allowed_headers),
            args.allow_credentials,
        ),
        log_requests=getattr(args, "enable_log_requests", False),
        max_log_len=getattr(args, "max_log_len", None),
        image_limit=(getattr(args, "limit_mm_per_prompt", None) or {}).get("image"),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        force_include_usage=getattr(args, "enable_force_include_usage", False),
        request_id_headers=getattr(args, "enable_request_id_headers", False),
        api_docs=not getattr(args, "disable_fastapi_docs", False),
        chat_template_content_format=getattr(args, "chat_template_content_format", "auto"),
    )
    server = DrainingServer(config, client, float(args.shutdown_timeout), peers, ignore_sigint)
    freeze_startup_heap("HTTP process")
    # uvicorn re-raises the signal that stopped it once it has drained; a Python-level handler makes
    # that a no-op, so a SIGTERM'd server exits 0 after its drain instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    return server


def _any_if_unset(given: list[str] | None) -> list[str]:
    return ["*"] if given is None else given


def _uvicorn_config(args: argparse.Namespace) -> Any:
    import uvicorn

    from .draining import FLUSH_S

    return uvicorn.Config(
        "deltaserve:unused",  # the app comes with the run below
        host=args.host,
        port=args.port,
        log_level=getattr(args, "uvicorn_log_level", None) or args.log_level,
        log_config=None,  # keep our one log format
        timeout_graceful_shutdown=FLUSH_S,  # the drain itself is DrainingServer's
        timeout_keep_alive=_KEEP_ALIVE_S,
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
        root_path=getattr(args, "root_path", ""),
        ssl_keyfile=getattr(args, "ssl_keyfile", None),
        ssl_certfile=getattr(args, "ssl_certfile", None),
        ssl_ca_certs=getattr(args, "ssl_ca_certs", None),
        ssl_cert_reqs=getattr(args, "ssl_cert_reqs", 0),
        uds=getattr(args, "uds", None),
    )


def _check_tls(args: argparse.Namespace) -> None:
    """Load the HTTPS key and certificates as uvicorn will, so that a wrong pair is one line now."""
    if not getattr(args, "ssl_certfile", None):
        return
    import ssl

    try:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs:
            context.load_verify_locations(args.ssl_ca_certs)
    except (ssl.SSLError, OSError) as exc:
        print(f"deltaserve serve: error: cannot serve HTTPS with these files: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _shared_metrics(handle: Any, count: int) -> Any:
    if count == 1:
        return None
    from .metrics import SharedMetrics

    return SharedMetrics(handle.ipc_dir, 0, count)


_KEEP_ALIVE_S = 60  # idle keep-alive connections: longer than clients' pools keep them


def _bind(config: Any) -> Any:
    import socket

    uds = getattr(config, "uds", None)
    if uds:
        return _bind_unix(uds)
    try:
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        # IPPROTO_TCP named, or asyncio leaves Nagle on for the connections it accepts: a response
        # written in two parts then waits for the client's delayed ACK on kept-alive connections
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((config.host, config.port))
    except OSError as exc:
        print(
            f"deltaserve serve: error: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr
        )
        raise SystemExit(1) from None
    sock.set_inheritable(True)
    return sock


def _raise_open_files_limit() -> None:
    # every client connection is a file: 1,024 streams need more than the usual soft limit
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            logger.warning("open files limited to %d: very many connections at once will fail", soft)


def _bind_unix(path: str) -> Any:
    """A Unix socket at `path` (vLLM's --uds), in place of any stale one a previous run left."""
    import socket

    try:
        if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
    except OSError as exc:
        print(f"deltaserve serve: error: cannot listen on {path}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    sock.set_inheritable(True)
    return sock


def _warn_if_accept_queue_capped(backlog: int, somaxconn: str = "/proc/sys/net/core/somaxconn") -> None:
    # as Redis does: a burst of connections past the kernel's cap is dropped before the server sees it
    try:
        with open(somaxconn) as f:
            cap = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return
    if cap < backlog:
        logger.warning(
            "the kernel caps the accept queue at %d connections (net.core.somaxconn), below the %d asked for: "
            "more clients than that connecting at once may lose their connections; raise it with sysctl",
            cap,
            backlog,
        )


def _served_names(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The names listed by /v1/models, and the names also accepted: by default the model folder's
    base name (as SGLang serves it) is listed, and the path given to --model stays accepted; a repo
    id is listed as given."""
    if args.served_model_name:
        return list(args.served_model_name), []
    if args.model is None:
        from deltaserve.models.checkpoints.builtin import BUILTIN_NAME

        return [BUILTIN_NAME], []
    from deltaserve.models.checkpoints.hub import is_repo_id

    if is_repo_id(args.model):  # listed as given (vLLM's and SGLang's name for it), its last part accepted
        return [args.model], [args.model.rsplit("/", 1)[-1]]
    path = str(args.model).rstrip("/") or str(args.model)
    base = os.path.basename(path) or path
    return [base], [path] if path != base else []


def _engine_config(args: argparse.Namespace) -> Any:
    from deltaserve.models.checkpoints.hub import CheckpointNotFound, is_repo_id, resolve_checkpoint

    model, tokenizer = args.model, args.tokenizer
    try:  # a repo id's files: from the Hub's cache, fetched first where they are not there
        if model is not None:
            model = resolve_checkpoint(
                model, args.revision, args.download_dir, weights=args.load_format != "dummy"
            )
        tokenizer_revision = getattr(args, "tokenizer_revision", None)
        if tokenizer is None and tokenizer_revision is not None and is_repo_id(args.model or ""):
            tokenizer = args.model  # vLLM's: the model repo's tokenizer files at that revision
        if tokenizer is not None:
            tokenizer = resolve_checkpoint(
                tokenizer, tokenizer_revision, args.download_dir, tokenizer_only=True
            )
    except CheckpointNotFound as exc:
        print(f"deltaserve serve: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if tokenizer is not None:
        from deltaserve.models.checkpoints.loader import require_tokenizer

        try:
            require_tokenizer(tokenizer, f"--tokenizer {args.tokenizer or args.model!r}")
        except ValueError as exc:
            print(f"deltaserve serve: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    if model is None:
        from deltaserve.models.checkpoints.builtin import builtin_model_path

        logger.info("no --model given: serving the built-in tiny random-weight Qwen3-Next model")
        model = builtin_model_path()
    from deltaserve.engine.config import EngineConfig

    try:
        config = EngineConfig(
            model=model,
            served_model_name=_served_names(args)[0][0],
            dtype=None if args.dtype == "auto" else args.dtype,
            device=None if args.device == "auto" else args.device,
            max_running_requests=args.max_running_requests,
            max_model_len=args.max_model_len,
            chunked_prefill_size=args.chunked_prefill_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_delay_steps=args.max_prefill_delay_steps,
            adaptive_prefill_delay=args.adaptive_prefill_delay,
            hold_prefill_tails=args.hold_prefill_tails,
            cache_type=args.cache_type,
            prefix_cache_policy=args.prefix_cache_policy,
            mem_fraction_static=args.mem_fraction_static,
            pool_memory_gb=args.pool_memory_gb,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            piecewise_cuda_graph_max_tokens=(
                args.piecewise_cuda_graph_max_tokens if args.enable_piecewise_cuda_graph else 0
            ),
            stream_interval=args.stream_interval,
            scheduling_policy=args.scheduling_policy,
            hf_overrides=args.hf_overrides,
            language_model_only=args.language_model_only,
            disable_cuda_graph=args.disable_cuda_graph,
            enable_overlap_schedule=args.enable_overlap_schedule,
            state_dtype=args.state_dtype,
            seed=args.seed,
            page_size=args.page_size,
            max_waiting_requests=args.max_waiting_requests,
            load_format=args.load_format,
            quantization=args.quantization,
            tokenizer=tokenizer,
            skip_tokenizer_init=getattr(args, "skip_tokenizer_init", False),
            speculative_config=args.speculative_config,
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=args.data_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            distributed_timeout_s=args.distributed_timeout,
        )
    except ValueError as exc:  # settings that only the engine's config checks (environment)
        print(f"deltaserve serve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    _check_gpus(config)
    _check_model_shape(config)
    return config


def _check_model_shape(config: Any) -> None:
    """A tensor-parallel size the model's heads (experts, widths) do not divide by, a
    --max-model-len past its positions, or MTP speculation without its weights: one line now, from
    its config.json and safetensors headers, rather than the engine's error once it is loading."""
    from deltaserve.models.checkpoints.loader import check_checkpoint

    try:
        check_checkpoint(config)
    except (ValueError, OSError) as exc:
        print(f"deltaserve serve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _check_gpus(config: Any) -> None:
    """Every data-parallel replica's tensor-parallel ranks on a GPU of their own, or one line now."""
    import torch

    if not str(config.device).startswith("cuda") or config.nnodes > 1:
        return
    first = torch.device(config.device).index or 0
    want = first + config.data_parallel_size * config.tensor_parallel_size
    have = torch.cuda.device_count()
    if want > have:
        print(
            f"deltaserve serve: error: --data-parallel-size {config.data_parallel_size} x "
            f"--tensor-parallel-size {config.tensor_parallel_size} from {config.device} needs GPUs up to "
            f"cuda:{want - 1}; {have} are visible",
            file=sys.stderr,
        )
        raise SystemExit(2)


def _serve_headless(args: argparse.Namespace) -> int:
    """A node other than 0: its tensor-parallel ranks, no HTTP. It ends when they do (node 0 stops
    them, or its engine goes), when one fails (the others are stopped), or on SIGTERM / SIGINT,
    which stops them."""
    if not args.headless or args.node_rank == 0:
        print(
            "deltaserve serve: error: --headless runs the ranks of a node other than 0 "
            "(give --node-rank N with N > 0 and --headless together)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    config = _engine_config(args)
    from deltaserve.engine.parallel.launcher import WorkerProcesses

    assert config.master_port is not None  # more than one node: the config checked it
    ranks = list(config.node_ranks)
    workers = WorkerProcesses(config, ranks, config.master_port)
    logger.info(
        "headless node %d of %d: tensor-parallel ranks %s, meeting rank 0 at %s:%d",
        config.node_rank,
        config.nnodes,
        ranks,
        config.master_addr,
        config.master_port,
    )
    told: list[int] = []

    def stop(sig: int, _frame: Any) -> None:
        told.append(sig)
        workers.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    rank, first = workers.wait_first()
    failed = bool(first) and not told
    if failed:  # the others may wait on it (joining, or in a step) for long: the node stops
        logger.error(
            "tensor-parallel rank %d of this node exited with code %d; stopping the others", rank, first
        )
        workers.terminate()
    workers.stop(timeout=_HEADLESS_STOP_S if failed else 30.0)  # then killed
    code = workers.wait()
    if code and not told:
        if not failed:
            logger.error("a tensor-parallel rank of this node exited with code %d", code)
        return 1
    logger.info("the ranks of this node stopped")
    return 0


# how long a failed node's other ranks get to end after SIGTERM before a kill (a stopped one never does)
_HEADLESS_STOP_S = 10.0


def _start_engines(
    config: Any,
    log_level: str,
    stats_interval_s: float,
    api_servers: int = 1,
    started: list[Any] | None = None,
) -> list[Any]:
    """The engine in its own process, or `data_parallel_size` of them, loading together; a load
    error ends the server with the engine's message (and stops the replicas already started).
    Each handle joins `started` (returned) as its process starts."""
    from .engine_client import EngineHandle

    replicas = [config.data_parallel_replica(rank) for rank in range(config.data_parallel_size)]
    handles = started if started is not None else []
    for c in replicas:
        handles.append(EngineHandle.start(c, log_level, stats_interval_s, api_servers))
    for rank, handle in enumerate(handles):
        try:
            handle.await_ready(None)
        except RuntimeError as exc:
            for other in handles:
                other.close()
            which = f" (data-parallel replica {rank})" if len(handles) > 1 else ""
            print(f"deltaserve serve: error: could not load {config.model}{which}: {exc}", file=sys.stderr)
            raise SystemExit(1) from None
    return handles


def _log_engine(client: Any) -> None:  # process 0 alone: the others would repeat it
    info = client.model_info
    logger.info("model: %s (%s)", info.get("model"), info.get("architecture", "?"))
    logger.info("dtype: %s, device: %s (engine process)", info.get("dtype", "?"), info.get("device", "?"))
    logger.info("parameters: %s", _human(info.get("num_params")))
    replicas = info.get("data_parallel_size", 1)
    if replicas > 1:
        logger.info("data parallel: %d engines, each with the pools below", replicas)
    logger.info(
        "KV capacity: %s tokens, state slots: %s, max model len: %d",
        info.get("kv_capacity_tokens", "?"),
        info.get("state_slots", "?"),
        client.max_model_len,
    )
    logger.info(
        "memory: weights %s, KV pool %s, state pool %s, %s snapshot slots %s; %s free",
        *(_gib(info.get(k)) for k in ("weights_bytes", "kv_pool_bytes", "state_pool_bytes")),
        info.get("snapshot_slots", "?"),
        _gib(info.get("snapshot_bytes")),
        _gib(info.get("free_memory_bytes")),
    )
    logger.info(
        "prefix cache: %s, policy %s; prefill budget: %s tokens a step (max_num_batched_tokens), "
        "%s a request (chunked_prefill_size)",
        info.get("cache_type", "?"),
        info.get("prefix_cache_policy", "?") if info.get("cache_type") == "radix" else "none",
        info.get("max_num_batched_tokens", "?"),
        info.get("chunked_prefill_size", "?"),
    )


def _sampling_defaults(args: argparse.Namespace, model_dir: Any, log: bool = True) -> Any:
    """`--generation-config`: the checkpoint's sampling defaults, logged when they differ from
    OpenAI's (the built-in model's generation_config.json sets only max_new_tokens)."""
    from deltaserve.engine.requests.generation_defaults import load_sampling_defaults

    try:
        defaults = load_sampling_defaults(getattr(args, "generation_config", "auto"), model_dir)
    except ValueError as exc:  # the model's own file is out of range: say so rather than guess
        raise SystemExit(f"deltaserve: error: {exc} (--generation-config none ignores it)") from None
    warning = defaults.warning()
    if warning and log:
        logger.warning("%s", warning)
    changed = defaults.changed()
    if changed and log:
        logger.info(
            "sampling defaults from generation_config.json (a request's own values win): %s",
            ", ".join(f"{k}={v}" for k, v in changed.items()),
        )
    return defaults


def _gib(size: Any) -> str:
    if not isinstance(size, (int, float)):
        return "?"
    return f"{size / 2**30:.{2 if size >= 2**30 else 3}f} GiB"  # small models' pools too show


def _human(count: Any) -> str:
    if not isinstance(count, (int, float)):
        return "?"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit} ({int(count):,})"
    return str(count)
