"""`deltaserve serve`: load the engine, log what was loaded, run the HTTP server until SIGTERM."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
import threading
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
    engine = _load_engine(args)
    if engine.tokenizer is not None and importlib.util.find_spec("xgrammar") is not None:
        # JSON output's vocabulary tables, built beside start-up rather than at the first request
        threading.Thread(target=engine.prepare_grammars, name="deltaserve-grammars", daemon=True).start()
    from .app import build_app
    from .chat_template import load_chat_template
    from .engine_client import EngineClient
    from .metrics import Metrics

    sampling_defaults = _sampling_defaults(args, engine.model_info.get("model"))
    names = args.served_model_name or [engine.model_info.get("served_model_name") or _default_name(args)]
    client = EngineClient(engine, Metrics(names[0]))
    app = build_app(
        client,
        model_names=names,
        chat_template=load_chat_template(args.chat_template),
        api_key=args.api_key,
        sampling_defaults=sampling_defaults,
    )
    import uvicorn

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,  # keep our one log format
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal that stopped it once it has drained; a Python-level handler makes
    # that a no-op, so a SIGTERM'd server exits 0 after its drain instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    logger.info(
        "serving %s on http://%s:%d (API key %s)",
        ", ".join(names),
        args.host,
        args.port,
        "required" if args.api_key else "not required",
    )
    server.run()
    if not server.started:
        raise SystemExit(1)
    logger.info("shut down cleanly")
    return 0


def _default_name(args: argparse.Namespace) -> str:
    if args.model is None:
        from deltaserve.models.builtin import BUILTIN_NAME

        return BUILTIN_NAME
    return str(args.model).rstrip("/")


def _load_engine(args: argparse.Namespace) -> Any:
    model = args.model
    if model is None:
        from deltaserve.models.builtin import builtin_model_path

        logger.info("no --model given: serving the built-in tiny random-weight Qwen3-Next model")
        model = builtin_model_path()
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import Engine

    try:
        config = EngineConfig(
            model=model,
            served_model_name=(args.served_model_name or [_default_name(args)])[0],
            dtype=None if args.dtype == "auto" else args.dtype,
            device=None if args.device == "auto" else args.device,
            max_running_requests=args.max_running_requests,
            max_model_len=args.max_model_len,
            chunked_prefill_size=args.chunked_prefill_size,
            cache_type=args.cache_type,
            prefix_cache_policy=args.prefix_cache_policy,
            mem_fraction_static=args.mem_fraction_static,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            disable_cuda_graph=args.disable_cuda_graph,
            enable_overlap_schedule=args.enable_overlap_schedule,
            state_dtype=args.state_dtype,
            seed=args.seed,
            page_size=args.page_size,
            max_waiting_requests=args.max_waiting_requests,
            load_format=args.load_format,
            tokenizer=args.tokenizer,
            speculative_config=args.speculative_config,
        )
    except ValueError as exc:  # settings that only the engine's config checks (environment)
        print(f"deltaserve serve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        engine = Engine(config)
    except (ValueError, OSError, RuntimeError, KeyError) as exc:
        logger.debug("engine start-up failed", exc_info=True)
        print(f"deltaserve serve: error: could not load {model}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    info = engine.model_info
    _leave_a_core_for_http(str(info.get("device", "")))
    logger.info("model: %s (%s)", info.get("model", model), info.get("architecture", "?"))
    logger.info("dtype: %s, device: %s", info.get("dtype", "?"), info.get("device", "?"))
    logger.info("parameters: %s", _human(info.get("num_params")))
    logger.info(
        "KV capacity: %s tokens, state slots: %s, max model len: %d",
        info.get("kv_capacity_tokens", "?"),
        info.get("state_slots", "?"),
        engine.max_model_len,
    )
    return engine


def _leave_a_core_for_http(device: str) -> None:
    # On CPU, torch's intra-op threads busy-wait on every core; the HTTP event loop (tokenizing,
    # streaming) then fights them and both slow down severalfold. One core for the loop is cheaper.
    import torch

    cores = os.cpu_count() or 1
    if device.startswith("cpu") and cores > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(torch.get_num_threads(), cores - 1))


def _sampling_defaults(args: argparse.Namespace, model_dir: Any) -> Any:
    """`--generation-config`: the checkpoint's sampling defaults, logged when they differ from
    OpenAI's (the built-in model's generation_config.json sets only max_new_tokens)."""
    from deltaserve.engine.generation_defaults import load_sampling_defaults

    try:
        defaults = load_sampling_defaults(getattr(args, "generation_config", "auto"), model_dir)
    except ValueError as exc:  # the model's own file is out of range: say so rather than guess
        raise SystemExit(f"deltaserve: error: {exc} (--generation-config none ignores it)") from None
    changed = defaults.changed()
    if changed:
        logger.info(
            "sampling defaults from generation_config.json (a request's own values win): %s",
            ", ".join(f"{k}={v}" for k, v in changed.items()),
        )
    return defaults


def _human(count: Any) -> str:
    if not isinstance(count, (int, float)):
        return "?"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit} ({int(count):,})"
    return str(count)
