"""The `deltaserve` command line. Importing this module stays cheap (no torch) so --help is instant."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import NoReturn, TypeVar

from deltaserve import __version__
from deltaserve.engine.stats_log import STATS_INTERVAL_S
from deltaserve.server.engine_router import METHODS

_Number = TypeVar("_Number", int, float)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, no usage dump and no traceback; exit code 2 as argparse does.
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        # "(default: None)", "(default: False)" of a switch and "(default: )" say nothing
        if action.default is None or action.default is False or action.default == "":
            return action.help
        return super()._get_help_string(action)


def _at_least(low: _Number, kind: Callable[[str], _Number]) -> Callable[[str], _Number]:
    def parse(text: str) -> _Number:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    value = _float_at_least(0.0)(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {value}")
    return value


def _name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("a name cannot be empty")
    return text


def _int_at_least(low: int) -> Callable[[str], int]:
    return _at_least(low, int)


def _float_at_least(low: float) -> Callable[[str], float]:
    return _at_least(low, float)


def _power_of_two(text: str) -> int:
    value = _int_at_least(1)(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {value}")
    return value


# vLLM's suffixes: lowercase decimal (32k = 32,000), uppercase binary (32K = 32,768)
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _human_readable_int_at_least(low: int) -> Callable[[str], int]:
    """An integer as vLLM's --max-model-len, --max-num-batched-tokens and --kv-cache-memory-bytes
    take it: plain, or with a suffix k/m/g/t (powers of 1000, a fraction allowed: 25.6k = 25,600)
    or K/M/G/T (powers of 1024, whole numbers only)."""
    plain = _int_at_least(low)

    def parse(text: str) -> int:
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text.strip())
        if match is None:
            return plain(text)
        number, suffix = match.groups()
        if suffix in _BINARY_SUFFIXES:
            if "." in number:
                raise argparse.ArgumentTypeError(
                    f"decimals are not allowed with binary suffixes like {suffix} (got {text!r}); "
                    f"did you mean {number}{suffix.lower()}?"
                )
            value = int(number) * _BINARY_SUFFIXES[suffix]
        else:
            # exact, then cut to a whole number as vLLM does: in floats 1.001k would be 1000
            value = int(Fraction(number) * _DECIMAL_SUFFIXES[suffix])
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value} ({text!r})")
        return value

    return parse


def _max_model_len(text: str) -> int:
    """--max-model-len: vLLM's human-readable integer, or -1 / auto (any case) for the longest
    context the pools hold, up to the model's positions."""
    if text.strip().lower() in ("-1", "auto"):
        return -1
    return _human_readable_int_at_least(2)(text)


def _bytes_in_gib(text: str) -> float:
    return _human_readable_int_at_least(1)(text) / 2**30


def _body_mib(text: str) -> float:
    """--max-request-body-mb: MiB that come to at least one byte (the limit is a whole number of bytes)."""
    value = _positive_float(text)
    if int(value * 2**20) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte ({1 / 2**20:.3g} MiB), got {value}")
    return value


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be at most 65535, got {value}")
    return value


def _device(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def _checkpoint(text: str) -> str:
    """A folder, or a Hugging Face repo id (`org/name`), fetched at start-up (`models.checkpoints.hub`)."""
    from deltaserve.models.checkpoints.hub import is_repo_id

    if not os.path.exists(text) and not is_repo_id(text):
        raise argparse.ArgumentTypeError(
            f"no such file or directory, nor a Hugging Face repo id (org/name): {text!r}"
        )
    return text


def _speculative_config(text: str) -> dict:
    """A JSON object, checked as the engine checks it, so that a typo is a one-line error."""
    value = _json_object(text)
    from deltaserve.engine.spec_decode.config import SpecConfig

    try:
        SpecConfig.from_dict(value)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _generation_config(text: str) -> str:
    """auto, none (vllm) or a folder whose generation_config.json is readable and in range."""
    if text in ("auto", "none", "vllm"):
        return text
    from deltaserve.engine.requests.generation_defaults import load_sampling_defaults

    try:
        load_sampling_defaults(text, None)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _json_strings(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings, e.g. ["*"], got {text!r}')
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _readable_file(text: str) -> str:
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not a readable file")
    return text


def _chat_template(text: str) -> str:
    """A template file, or the template itself on one line (vLLM takes either), that parses as
    Jinja: a syntax error would otherwise fail every chat request."""
    if not os.path.isfile(text) and "{{" not in text and "{%" not in text:
        raise argparse.ArgumentTypeError(f"no such file, nor a Jinja template: {text!r}")
    import jinja2
    from jinja2.ext import Extension

    class GenerationTag(Extension):  # transformers' {% generation %} ... {% endgeneration %}
        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    try:
        source = open(text, encoding="utf-8").read() if os.path.isfile(text) else text
        # parsed only: filters and globals are the renderer's (transformers'), checked as it renders
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols", GenerationTag]).parse(source)
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc}") from None
    except jinja2.TemplateSyntaxError as exc:
        raise argparse.ArgumentTypeError(f"not valid Jinja: {exc.message} (line {exc.lineno})") from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="deltaserve", description="OpenAI-compatible server for hybrid linear-attention LLMs."
    )
    parser.add_argument("--version", action="version", version=f"deltaserve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...).",
        formatter_class=_HelpFormatter,
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,  # checked once every flag is known (parse_args): a stray flag's value lands here
        metavar="MODEL",
        help="the model, as with --model (`deltaserve serve Qwen/Qwen3.5-9B`, as vLLM takes it)",
    )
    model = serve.add_argument_group("model")
    model.add_argument(
        "--model",
        "--model-path",
        type=_checkpoint,
        default=None,
        help="checkpoint folder (config.json, safetensors, tokenizer) or Hugging Face repo id "
        "(org/name: fetched into the Hub's cache at start-up, or found there offline); without it the "
        "built-in tiny random-weight Qwen3-Next model is built on first use and served",
    )
    model.add_argument(
        "--revision",
        default=None,
        help="a repo id's branch, tag or commit; default: main",
    )
    model.add_argument(
        "--download-dir",
        default=None,
        help="where a repo id's files are kept; default: the Hugging Face cache ($HF_HOME)",
    )
    model.add_argument(
        "--served-model-name",
        nargs="+",
        type=_name,
        default=None,
        metavar="NAME",
        help="name(s) clients use in the 'model' field; default: the --model folder's name (a repo id "
        "as given), or the built-in model's name",
    )
    model.add_argument(
        "--tokenizer", type=_checkpoint, default=None, help="tokenizer folder or repo id, if not the model's"
    )
    model.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="load no tokenizer (vLLM's flag): prompts are token ids and outputs carry token ids "
        "with empty text; chat, text prompts and stop strings are a 400",
    )
    model.add_argument(
        "--tokenizer-revision",
        default=None,
        metavar="REV",
        help="the branch, tag or commit of the tokenizer's repo id: --tokenizer's, else the model's "
        "(its tokenizer files at REV, its weights at --revision); default: main (vLLM's flag)",
    )
    model.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
        default="auto",
        help="weight and activation dtype; auto is bfloat16 on CUDA, float32 on CPU, whatever the "
        "checkpoint's own dtype; half and float are vLLM's names for float16 and float32",
    )
    model.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda or cuda:N")
    model.add_argument(
        "--load-format",
        choices=["auto", "safetensors", "dummy"],
        default="auto",
        help="auto (or safetensors, vLLM's name) loads the safetensors weights; dummy uses random "
        "weights of the checkpoint's shapes",
    )
    model.add_argument(
        "--quantization",
        choices=["fp8"],
        default=None,
        help="fp8: quantize an unquantized checkpoint's linear weights to block FP8 as they load "
        "(block-FP8 checkpoints are detected from their config without this flag)",
    )
    model.add_argument(
        "--generation-config",
        type=_generation_config,
        default="auto",
        metavar="auto|none|FOLDER",
        help="sampling defaults for requests that leave them unset (temperature, top_p, top_k, min_p, "
        "repetition_penalty, and max_new_tokens as the default max_tokens): auto reads the model's "
        "generation_config.json, none keeps OpenAI's, or a folder holding a generation_config.json",
    )
    model.add_argument(
        "--seed", type=int, default=0, help="seed for weight init (dummy) and unseeded sampling"
    )

    engine = serve.add_argument_group("engine")
    engine.add_argument(
        "--max-running-requests",
        "--max-num-seqs",
        type=_int_at_least(1),
        default=None,
        help="most requests decoded together; default 256 on CUDA, 64 on CPU, lowered at start-up "
        "to what memory holds (state slots)",
    )
    engine.add_argument(
        "--max-waiting-requests",
        type=_int_at_least(0),
        default=1024,
        help="requests queued beyond the running ones before new ones get HTTP 503",
    )
    engine.add_argument(
        "--max-model-len",
        "--context-length",
        type=_max_model_len,
        default=None,
        help="longest prompt plus completion in tokens, plain or as vLLM writes it (32k = 32,000, "
        "32K = 32,768, 25.6k = 25,600), or -1 / auto: the model's positions, lowered to what the "
        "pools hold for one request; default: the model's max_position_embeddings",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=_human_readable_int_at_least(1),
        default=None,
        help="tokens one step computes, decode rows and prefill chunks together (16k, 16K as "
        "--max-model-len takes them); default 8192 on "
        "CUDA, 512 on CPU, or --chunked-prefill-size where that is larger",
    )
    engine.add_argument(
        "--chunked-prefill-size",
        type=_int_at_least(1),
        default=None,
        help="largest prefill chunk of one request in one step, cut to --max-num-batched-tokens "
        "where that is given and smaller; default: the step's budget",
    )
    engine.add_argument(
        "--max-prefill-delay-steps",
        type=_int_at_least(0),
        default=0,
        help="new prompts that arrive while the running requests only decode wait up to this many "
        "steps to be prefilled together (a decode-only step replays a CUDA graph, a step with a "
        "prefill runs eagerly); 0: prefill at once, or with the adaptive delay (on with CUDA) wait "
        "up to 16 steps",
    )
    engine.add_argument(
        "--adaptive-prefill-delay",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let such prompts wait while one more step's wait costs less than it saves, as measured "
        "while serving (a prefill step's fixed cost beyond a decode step, and the arrival rate); at "
        "most --max-prefill-delay-steps steps, or 16 when that is 0; default: on with CUDA, off on CPU",
    )
    engine.add_argument(
        "--hold-prefill-tails",
        action="store_true",
        help="with the adaptive prefill delay (which it needs: without it, a start-up error), running "
        "prompts' remaining chunks (the short tail the prefix cache leaves after a prompt's last full "
        "page) wait with the arrivals too; experimental: measured on a GPU without a clear gain",
    )
    engine.add_argument(
        "--page-size",
        "--block-size",
        type=_power_of_two,
        default=16,
        help="tokens per KV-cache page (a power of two)",
    )
    engine.add_argument(
        "--cache-type",
        choices=["radix", "naive"],
        default="radix",
        help="prefix cache: radix reuses KV pages and recurrent-state snapshots across requests, "
        "naive turns reuse off",
    )
    engine.add_argument(
        "--prefix-cache-policy",
        choices=["marconi", "branch_lru", "every_chunk_lru"],
        default="marconi",
        help="which recurrent-state snapshots the radix cache keeps: marconi (branch points and "
        "sequence ends, evicted by recency and FLOPs saved per byte) or one of the two LRU baselines",
    )
    engine.add_argument(
        "--mem-fraction-static",
        "--gpu-memory-utilization",
        type=_fraction,
        default=0.85,
        help="fraction of GPU memory for weights, KV pages and state slots (the pools get what the "
        "weights leave)",
    )
    engine.add_argument(
        "--pool-memory-gb",
        type=_positive_float,
        default=None,
        help="memory for KV pages and state slots in GiB, on CUDA instead of what "
        "--mem-fraction-static leaves; default: CPU a quarter of the memory available at start-up",
    )
    engine.add_argument(
        "--kv-cache-memory-bytes",
        dest="pool_memory_gb",
        type=_bytes_in_gib,
        default=None,  # --pool-memory-gb's default stands: the first flag of a dest sets it
        metavar="BYTES",
        help="vLLM's: --pool-memory-gb in bytes, plain or with a suffix (2G = 2 GiB, 2g = 2e9 bytes) "
        "(its KV cache holds a hybrid model's states too)",
    )
    engine.add_argument(
        "--hf-overrides",
        "--json-model-override-args",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="values set on the checkpoint's config before the model is built (vLLM's flag; SGLang's "
        "--json-model-override-args), e.g. a YaRN rope_parameters for contexts past the native length",
    )
    engine.add_argument(
        "--language-model-only",
        action="store_true",
        help="a vision-language checkpoint (Qwen3.5) served as text alone: its vision tower is not loaded",
    )
    engine.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="fcfs: requests run in arrival order; priority: by each request's `priority` field, lower "
        "values first, and memory pressure preempts the lowest (vLLM's flag)",
    )
    engine.add_argument(
        "--cuda-graph-max-bs",
        "--max-cudagraph-capture-size",
        type=_int_at_least(1),
        default=256,
        help="largest decode batch run by CUDA-graph replay (vLLM's --max-cudagraph-capture-size: "
        "its graphs count tokens, one a request in a decode step)",
    )
    engine.add_argument(
        "--enable-piecewise-cuda-graph",
        action="store_true",
        help="run steps with prefill chunks of up to --piecewise-cuda-graph-max-tokens tokens by "
        "replaying CUDA graphs of the forward between its attention and linear-attention ops (SGLang's flag)",
    )
    engine.add_argument(
        "--piecewise-cuda-graph-max-tokens",
        type=_int_at_least(16),
        default=512,
        help="the most tokens a step replayed in pieces holds",
    )
    engine.add_argument(
        "--disable-cuda-graph",
        "--enforce-eager",
        action="store_true",
        help="run decode eagerly (no CUDA-graph capture)",
    )
    overlap = engine.add_mutually_exclusive_group()
    overlap.add_argument(
        "--disable-overlap-schedule",
        dest="enable_overlap_schedule",
        action="store_const",
        const=False,
        default=None,
        help="read each step's tokens back before scheduling the next (overlap scheduling is on by "
        "default on CUDA: step N+1 is launched before step N's tokens are read back)",
    )
    overlap.add_argument(
        "--enable-overlap-schedule",
        dest="enable_overlap_schedule",
        action="store_const",
        const=True,
        help="overlap scheduling on a CPU device too (it gains nothing there; for tests)",
    )
    engine.add_argument(
        "--state-dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of the recurrent (linear-attention) state",
    )
    engine.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4}\'',
    )

    parallel = serve.add_argument_group("parallelism")
    parallel.add_argument(
        "--tensor-parallel-size",
        "-tp",
        "--tp-size",
        "--tp",
        type=_int_at_least(1),
        default=1,
        help="ranks the model is split over, one process (one GPU) each; rank 0 schedules and samples",
    )
    parallel.add_argument(
        "--data-parallel-size",
        "-dp",
        "--dp-size",
        "--dp",
        type=_int_at_least(1),
        default=1,
        help="engine replicas, each with its own GPUs (--tensor-parallel-size of them) and requests; "
        "the HTTP processes route each request to one, by shared prompt prefix and load",
    )
    parallel.add_argument(
        "--load-balance-method",
        choices=METHODS,
        default=METHODS[0],
        help="with --data-parallel-size: which engine takes a request (cache_aware: the one holding the "
        "longest part of its prompt unless it is busier; shortest_queue: the least busy; round_robin)",
    )
    parallel.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models: each rank holds whole experts (num_experts / tensor-parallel size of them) "
        "instead of a slice of every expert; no effect at one rank",
    )
    parallel.add_argument(
        "--nnodes",
        type=_int_at_least(1),
        default=1,
        help="machines the ranks are spread over (evenly); every node runs the same command",
    )
    parallel.add_argument(
        "--node-rank",
        type=_int_at_least(0),
        default=0,
        help="this machine's place among --nnodes: node 0 serves HTTP, the others run --headless",
    )
    parallel.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="node 0's address, where the ranks meet (torch.distributed's TCP rendezvous)",
    )
    parallel.add_argument(
        "--master-port",
        type=_port,
        default=None,
        help="node 0's rendezvous port; default: a free port (one node only)",
    )
    parallel.add_argument(
        "--distributed-timeout",
        type=float,
        default=300.0,
        help="seconds the ranks wait for each other to join before start-up fails",
    )
    parallel.add_argument(
        "--headless",
        action="store_true",
        help="run this node's ranks without an HTTP server (every node but node 0)",
    )

    http = serve.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    http.add_argument("--port", type=_port, default=8000, help="port to listen on (0: a free one, logged)")
    http.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="listen on this Unix domain socket instead of --host and --port (vLLM's flag)",
    )
    http.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every /v1 route; default: $DELTASERVE_API_KEY",
    )
    http.add_argument(
        "--max-request-body-mb",
        type=_body_mib,
        default=32.0,
        help="largest request body in MiB; a larger one gets HTTP 413 before it is read",
    )
    http.add_argument(
        "--allowed-origins",
        type=_json_strings,
        default=None,
        metavar="JSON",
        help='origins a browser may call the API from (CORS), as a JSON list; default ["*"], any '
        "origin, as vLLM and SGLang allow; [] sends no CORS headers",
    )
    http.add_argument(
        "--allowed-methods",
        type=_json_strings,
        default=None,
        metavar="JSON",
        help='methods such calls may use (CORS), as a JSON list; default ["*"]',
    )
    http.add_argument(
        "--allowed-headers",
        type=_json_strings,
        default=None,
        metavar="JSON",
        help='request headers such calls may send (CORS), as a JSON list; default ["*"]',
    )
    http.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let such calls carry the browser's cookies and credentials (CORS)",
    )
    http.add_argument(
        "--ssl-keyfile",
        type=_readable_file,
        default=None,
        metavar="PATH",
        help="serve HTTPS: the server's private key (PEM), with --ssl-certfile",
    )
    http.add_argument(
        "--ssl-certfile",
        type=_readable_file,
        default=None,
        metavar="PATH",
        help="serve HTTPS: the server's certificate chain (PEM), with --ssl-keyfile",
    )
    http.add_argument(
        "--ssl-ca-certs",
        type=_readable_file,
        default=None,
        metavar="PATH",
        help="CA certificates (PEM) that clients' certificates are verified against (--ssl-cert-reqs)",
    )
    http.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="clients' certificates: 0 not asked for, 1 verified when sent, 2 required (mutual TLS); "
        "Python's ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED",
    )
    http.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="the path under which a reverse proxy serves the API (ASGI root_path, for /docs' links); "
        "the routes themselves stay where they are, as the proxy strips the prefix",
    )
    http.add_argument(
        "--chat-template",
        type=_chat_template,
        default=None,
        help="Jinja chat template to use instead of the tokenizer's: a file, or the template itself",
    )
    http.add_argument(
        "--chat-template-content-format",
        choices=["auto", "string", "openai"],
        default="auto",
        help="how a message's content reaches the chat template (vLLM's flag): auto and string join its "
        "text parts into a string (a message with images stays a list of parts), openai always a list "
        "of parts ([{'type': 'text', 'text': ...}]), for templates that iterate content",
    )
    http.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat request's own chat_template (Jinja, sandboxed) instead of refusing it "
        "with a 400: only for clients you trust",
    )
    http.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="no /docs, /redoc or /openapi.json (404), as vLLM's flag",
    )
    http.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="every response carries an X-Request-Id header: the request's own, else a fresh one "
        "(vLLM's flag; a request's X-Request-Id is always echoed)",
    )
    http.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every streamed chat or completion ends with its usage chunk, as if stream_options "
        "set include_usage (vLLM's flag)",
    )
    http.add_argument(
        "--api-server-count",
        type=_int_at_least(1),
        default=None,
        help="HTTP processes sharing the port (tokenizing, streaming, JSON), each talking to the one "
        "engine process: more than one helps small models at hundreds of streams (default: with a CUDA "
        "device and at least 8 cores 2, or one per data-parallel engine where the cores allow; else 1)",
    )
    http.add_argument(
        "--stream-interval",
        type=_int_at_least(1),
        default=1,
        metavar="N",
        help="a stream's first token is sent at once, later ones N at a time (and at the end): fewer, "
        "larger chunks cost the server less at hundreds of streams (vLLM's and SGLang's flag)",
    )
    http.add_argument(
        "--shutdown-timeout",
        type=_int_at_least(0),
        default=30,
        help="seconds SIGTERM waits for running requests to finish before aborting them",
    )
    http.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no access line for each request (vLLM's flag; at thousands of requests a second the lines cost "
        "the HTTP processes' CPU)",
    )
    http.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error", "critical"],
        default="info",
        help="log verbosity",
    )
    http.add_argument(
        "--uvicorn-log-level",
        choices=["trace", "debug", "info", "warning", "error", "critical"],
        default=None,
        help="uvicorn's own loggers' verbosity (vLLM's flag; its access lines are info); default: --log-level",
    )
    http.add_argument(
        "--log-stats-interval",
        type=_float_at_least(0.0),
        default=STATS_INTERVAL_S,
        metavar="SECONDS",
        help="while the engine works, log a line this often: prompt and generation tok/s, requests "
        "running and waiting, KV pages and state slots in use, prefix cache hits; 0: never",
    )
    http.add_argument(
        "--enable-log-requests",
        "--log-requests",
        action="store_true",
        help="log each request as it is submitted: its id, its prompt's token ids and the parameters it "
        "sets (vLLM's flag; SGLang's --log-requests)",
    )
    http.add_argument(
        "--max-log-len",
        type=_int_at_least(0),
        default=None,
        metavar="N",
        help="with --enable-log-requests, show at most N of a prompt's token ids (default: all)",
    )
    http.add_argument(
        "--disable-log-stats", action="store_true", help="no stats line (vLLM's flag; --log-stats-interval 0)"
    )
    _add_compatible_flags(serve.add_argument_group("vLLM's and SGLang's flags"))
    return parser


# vLLM's and SGLang's names for what deltaserve does anyway, so that their command lines (a model
# card's `vllm serve ... --trust-remote-code --enable-auto-tool-choice --tool-call-parser hermes`)
# run unchanged; a value deltaserve does not do (an fp8 KV cache) stays an error
TOOL_CALL_PARSERS = ["hermes", "qwen", "qwen25", "qwen3_xml", "qwen3_coder", "kimi_k2"]
REASONING_PARSERS = ["qwen3", "qwen3-thinking", "deepseek_r1", "deepseek-r1", "kimi", "kimi_k2"]


def _kv_cache_dtype(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(
            f"only auto: the KV cache is kept in the model's dtype (a {text} KV cache is not implemented)"
        )
    return text


def _pipeline_parallel_size(text: str) -> int:
    value = _int_at_least(1)(text)
    if value != 1:
        raise argparse.ArgumentTypeError(
            "only 1: pipeline parallelism is not implemented (split the model over more ranks with "
            "--tensor-parallel-size)"
        )
    return value


# switches for what deltaserve always does: (flag, why they change nothing)
_ALWAYS = (
    (
        "--trust-remote-code",
        "deltaserve runs its own code for these architectures and tokenizers, never a checkpoint's",
    ),
    ("--enable-chunked-prefill", "prefill is always chunked"),
    ("--enable-auto-tool-choice", 'tool_choice "auto" is always served'),
    ("--enable-metrics", "/metrics is always served"),
    ("--disable-log-requests", "requests are not logged unless --enable-log-requests asks"),
    ("--enable-prompt-tokens-details", "usage always carries prompt_tokens_details.cached_tokens"),
    ("--enable-reasoning", "reasoning between <think> tags always goes to reasoning_content"),
)


def _media_limits(text: str) -> dict:
    """`{"image": N}`, or vLLM's newer `{"image": {"count": N, "width": ..., "height": ...}}`,
    whose sizes only shape vLLM's memory profiling: the count is the limit."""
    limits = {k: v.get("count") if isinstance(v, dict) else v for k, v in _json_object(text).items()}
    bad = {k: v for k, v in limits.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0}
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: each count must be a whole number, 0 or more")
    return limits


def _state_dtype(text: str) -> str:
    value = "float32" if text == "auto" else text
    if value not in ("float32", "bfloat16", "float16"):
        raise argparse.ArgumentTypeError(f"{text!r}: one of auto, float32, bfloat16, float16")
    return value


def _speculative_from_sglang(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """SGLang's NEXTN / EAGLE flags as deltaserve's speculative_config (mtp, a chain of drafts)."""
    given = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    if args.speculative_algorithm is None:
        if any(v is not None for v in given):
            parser.error("--speculative-num-steps and the like go with --speculative-algorithm NEXTN")
        return
    if args.speculative_config is not None:
        parser.error("give --speculative-config or --speculative-algorithm, not both")
    steps, _, drafts = given
    if steps is None:
        steps = drafts - 1 if drafts is not None else 1
    if drafts is not None and drafts != steps + 1:
        parser.error(
            f"--speculative-num-draft-tokens {drafts} with topk 1 must be --speculative-num-steps + 1 ({steps + 1})"
        )
    args.speculative_config = {"method": "mtp", "num_speculative_tokens": steps}


def _add_compatible_flags(group: argparse._ArgumentGroup) -> None:
    for flags, cache, help in (
        (["--enable-prefix-caching"], "radix", "vLLM's: --cache-type radix (the default)"),
        (
            ["--no-enable-prefix-caching", "--disable-radix-cache"],
            "naive",
            "vLLM's and SGLang's: --cache-type naive",
        ),
    ):
        group.add_argument(
            *flags, dest="cache_type", action="store_const", const=cache, default=None, help=help
        )
    for flag, why in _ALWAYS:
        group.add_argument(flag, action="store_true", help=f"accepted, no effect: {why}")
    group.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="accepted, no effect: deltaserve reads the tool-call form the model writes (Qwen's "
        "<tool_call> JSON or XML, Kimi's sections)",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="accepted, no effect: reasoning between <think> tags always goes to reasoning_content",
    )
    group.add_argument(
        "--mm-encoder-tp-mode",
        choices=["weights", "data"],
        default=None,
        help="accepted, no effect: the vision tower runs whole on one GPU",
    )
    group.add_argument(
        "--limit-mm-per-prompt",
        type=_media_limits,
        default=None,
        metavar="JSON",
        help="the most images a prompt may carry ('{\"image\": 4}'; 0 refuses them); videos are never read",
    )
    for flag in ("--mamba-ssm-dtype", "--mamba-ssm-cache-dtype"):  # SGLang's, vLLM's
        group.add_argument(
            flag,
            dest="state_dtype",
            type=_state_dtype,
            default=None,  # --state-dtype's default stands: the first flag of a dest sets it
            help="--state-dtype (auto: its default, float32)",
        )
    for flag, kind, choices, help in (  # SGLang's NEXTN flags: the MTP drafter, a chain of drafts
        (
            "--speculative-algorithm",
            str,
            ["NEXTN", "EAGLE"],
            "the checkpoint's MTP layer drafts (method mtp)",
        ),
        ("--speculative-num-steps", _int_at_least(1), None, "drafts a step (num_speculative_tokens)"),
        ("--speculative-eagle-topk", int, [1], "1 only (a chain of drafts, no tree)"),
        (
            "--speculative-num-draft-tokens",
            _int_at_least(2),  # the last token and at least one draft
            None,
            "with topk 1, --speculative-num-steps + 1 (at least 2)",
        ),
    ):
        group.add_argument(flag, type=kind, choices=choices, default=None, help=f"SGLang's: {help}")
    group.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        "--pp-size",
        type=_pipeline_parallel_size,
        default=1,
        help="vLLM's and SGLang's: 1 only (the ranks split each layer, --tensor-parallel-size; "
        "pipeline parallelism is not implemented)",
    )
    group.add_argument(
        "--distributed-executor-backend",
        choices=["mp"],
        default=None,
        help="vLLM's: mp only, accepted, no effect: every rank is a process of its own",
    )
    group.add_argument(
        "--kv-cache-dtype",
        type=_kv_cache_dtype,
        default="auto",
        help="the KV cache is kept in the model's dtype (auto); an fp8 KV cache is not implemented",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with the checks that span flags (exit 2 with one line on a bad one)."""
    top = build_parser()
    args, extras = top.parse_known_args(argv)
    # a serve flag's error points at `deltaserve serve --help`, where the flags are
    parser = _command_parser(top, args.command)
    if extras:
        words = list(sys.argv[1:] if argv is None else argv)
        tag = getattr(args, "model_tag", None)
        # an unknown flag's value is taken for MODEL: name it with its flag, not as a missing model
        if (
            tag is not None
            and tag in words
            and words.index(tag) > 0
            and words[words.index(tag) - 1] in extras
        ):
            extras.insert(extras.index(words[words.index(tag) - 1]) + 1, tag)
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command == "serve":
        if args.model_tag is not None:
            try:
                _checkpoint(args.model_tag)
            except argparse.ArgumentTypeError as exc:
                parser.error(f"argument MODEL: {exc}")
            if args.model is not None and args.model != args.model_tag:
                parser.error(f"two models: MODEL {args.model_tag!r} and --model {args.model!r}")
            args.model = args.model_tag
        if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
            parser.error("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        if args.ssl_cert_reqs and args.ssl_ca_certs is None:
            parser.error("--ssl-cert-reqs verifies clients' certificates against --ssl-ca-certs: give it")
        if args.ssl_ca_certs is not None and args.ssl_keyfile is None:
            parser.error("--ssl-ca-certs is for HTTPS: give --ssl-keyfile and --ssl-certfile")
        _speculative_from_sglang(parser, args)
    return args


def _command_parser(top: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in top._subparsers._group_actions if top._subparsers else []:  # argparse keeps them here
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "serve":
        from .launch import serve

        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
