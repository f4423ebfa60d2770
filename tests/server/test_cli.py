"""`deltaserve serve` flags: help for each, one-line errors with exit code 2, docs listing them all."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME
from deltaserve.server.cli import build_parser

TLS = Path(__file__).parent / "tls"

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def serve_actions():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    serve = sub.choices["serve"]
    return [a for a in serve._actions if a.option_strings and a.dest != "help"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltaserve", *args], capture_output=True, text=True, timeout=60
    )


def test_help_explains_every_flag_without_importing_torch() -> None:
    code = (
        "import sys\nfrom deltaserve.server.cli import main\n"
        "try:\n    main(['serve', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out.strip().endswith("False")
    for empty in ("(default: None)", "(default: False)", "(default: )"):  # off or unset: the text says
        assert empty not in out
    for action in serve_actions():
        assert action.option_strings[0] in out
        assert action.help and len(action.help) > 10, action.option_strings


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "abc"],
        ["--port", "70000"],
        ["--dtype", "float8"],
        ["--device", "tpu"],
        ["--cache-type", "lru"],
        ["--state-dtype", "int8"],
        ["--max-running-requests", "0"],
        ["--max-model-len", "-5"],
        ["--max-model-len", "1"],  # a one-token prompt and its first token need two
        ["--chunked-prefill-size", "x"],
        ["--max-model-len", "25.6K"],  # vLLM allows no fraction with a binary suffix
        ["--max-model-len", "32kb"],
        ["--max-model-len", "0.001k"],  # 1 token
        ["--kv-cache-memory-bytes", "1.5G"],
        ["--max-num-batched-tokens", "-1k"],
        ["--load-format", "pickle"],
        ["--log-level", "loud"],
        ["--model", "/no/such/model/dir"],
        ["--chat-template", "/no/such/template.jinja"],
        ["--kv-cache-dtype", "fp8"],
        ["--tool-call-parser", "mistral"],
        ["--reasoning-parser", "granite"],
        ["--gpu-memory-utilization", "most"],
        ["--mem-fraction-static", "1.5"],
        ["--mem-fraction-static", "0"],
        ["--gpu-memory-utilization", "nan"],
        ["--pool-memory-gb", "inf"],
        ["--pool-memory-gb", "0"],
        ["--log-stats-interval", "nan"],
        ["--served-model-name", ""],
        ["--no-such-flag"],
        ["--ssl-keyfile", "/no/such/key.pem", "--ssl-certfile", str(TLS / "server.pem")],
        ["--ssl-keyfile", str(TLS / "server-key.pem")],  # HTTPS needs the certificate too
        [
            "--ssl-cert-reqs",
            "2",
            "--ssl-keyfile",
            str(TLS / "server-key.pem"),
            "--ssl-certfile",
            str(TLS / "server.pem"),
        ],
        ["--ssl-ca-certs", str(TLS / "ca.pem")],  # a CA for clients, with no HTTPS
        ["-dp", "0"],  # data parallelism needs a replica
        ["--limit-mm-per-prompt", '{"image": -1}'],  # a count below 0
        ["--limit-mm-per-prompt", '{"image": {"width": 512}}'],  # vLLM's object form without its count
        ["--speculative-eagle-topk", "4", "--speculative-algorithm", "NEXTN"],  # tree drafts
        ["--speculative-num-steps", "2"],  # without its algorithm
        ["--speculative-num-draft-tokens", "1", "--speculative-algorithm", "NEXTN"],  # no draft
        ["--pipeline-parallel-size", "2"],  # pipeline parallelism is not implemented
        ["--distributed-executor-backend", "ray"],
        ["--max-request-body-mb", "0"],  # every body would be a 413
        ["--max-request-body-mb", "-1"],
        ["--max-request-body-mb", "1e-9"],  # rounds to a limit of 0 bytes
    ],
)
def test_wrong_value_is_one_line_and_exit_2(args: list[str]) -> None:
    result = run_cli("serve", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in result.stderr, result.stderr
    flag = args[0]
    if flag != "--no-such-flag":
        assert flag in lines[0]
    assert lines[0].endswith("(see deltaserve serve --help)")  # where the serve flags are listed


@pytest.mark.parametrize(
    "args,named",
    [
        (["--model", "MODEL", "--swap-space", "16"], "--swap-space 16"),  # its value is no MODEL
        (["MODEL", "--swap-space", "16"], "--swap-space 16"),
        (["--model", "MODEL", "--uvicorn-log-level", "loud"], "--uvicorn-log-level"),
        (["no-such-model-folder"], "argument MODEL"),
    ],
)
def test_an_unknown_flag_with_its_value_is_named_as_such(
    args: list[str], named: str, builtin_path: str
) -> None:
    """An unknown flag's value is not taken for the model: the error names the flag and its value."""
    result = run_cli("serve", *[builtin_path if a == "MODEL" else a for a in args])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and named in lines[0], result.stderr


def test_vllms_uvicorn_log_level_sets_uvicorns_loggers() -> None:
    from deltaserve.server.cli import parse_args
    from deltaserve.server.launch import _uvicorn_config

    args = parse_args(["serve", "--uvicorn-log-level", "warning", "--log-level", "debug"])
    assert _uvicorn_config(args).log_level == "warning"
    assert _uvicorn_config(parse_args(["serve"])).log_level == "info"  # --log-level's, by default


def test_no_command_is_an_error() -> None:
    result = run_cli()
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_console_script_and_version() -> None:
    import shutil

    import deltaserve

    exe = shutil.which("deltaserve")
    assert exe is not None, "the deltaserve console script is not installed (pip install -e .)"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and deltaserve.__version__ in out.stdout


def docs_flag_rows() -> list[tuple[list[str], str, str]]:
    """docs/cli.md's flag tables: each row's names (aliases too), its flag cell and its default cell."""
    rows = []
    for line in DOCS.read_text().splitlines():
        if line.startswith("| `-"):
            flag_cell, default_cell = (c.strip() for c in line.strip().strip("|").split("|")[:2])
            rows.append((re.findall(r"`(--?[a-z][-a-z0-9]*)", flag_cell), flag_cell, default_cell))
    return rows


def test_docs_tables_match_the_parser_flag_for_flag() -> None:
    """Every name serve takes is in docs/cli.md's tables, in its flag's row, and every documented
    name is taken; choices and literal defaults read as the parser's."""
    rows = docs_flag_rows()
    documented = [name for names, _, _ in rows for name in names]
    assert len(documented) == len(set(documented)), "a flag is documented twice"
    actions = {name: a for a in serve_actions() for name in a.option_strings}
    assert not set(documented) - set(actions), (
        f"docs/cli.md documents flags serve does not take: {sorted(set(documented) - set(actions))}"
    )
    by_name = {name: row for row in rows for name in row[0]}
    for action in serve_actions():
        flag = action.option_strings[0]
        assert flag in by_name, f"{flag} is missing from docs/cli.md"
        names, flag_cell, default = by_name[flag]
        assert sorted(names) == sorted(action.option_strings), (
            f"docs/cli.md's row of {flag} names {names}, serve takes {action.option_strings}"
        )
        if action.choices is not None:
            shown = re.search(r"\{([^}]*)\}", flag_cell)
            assert shown and shown.group(1).split(",") == [str(c) for c in action.choices], (
                f"docs/cli.md shows {flag}'s choices as {flag_cell}, serve takes {list(action.choices)}"
            )
        if isinstance(action, argparse._StoreTrueAction):
            assert default == "off", f"docs/cli.md does not say {flag} is off by default"
        elif action.default == "":
            assert default == "none", f"docs/cli.md gives {flag}'s empty default as {default}"
        elif action.default is not None and action.const is None and flag != "--api-key":
            assert default.startswith(f"`{action.default}`"), (
                f"docs/cli.md gives {flag}'s default as {default}, serve's is {action.default}"
            )


def docs_serve_commands() -> list[tuple[str, list[str]]]:
    """Each `deltaserve serve ...` command in README.md and docs/*.md code (fenced blocks and inline
    spans), continuation lines joined and comments dropped, with the page it is on and its words."""
    root = DOCS.parents[1]
    commands = []
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text().replace("\\\n", " ")
        for code in re.findall(r"```.*?```|`[^`\n]+`", text, flags=re.S):
            for match in re.finditer(r"deltaserve\s+serve\b([^\n#`]*)", code):
                commands.append((f"{page.name}: {match.group(0).strip()}", shlex.split(match.group(1))))
    return commands


def test_docs_commands_use_flags_serve_takes() -> None:
    """A command a reader copies from the docs names only flags serve takes, with values among their
    choices (the tables are checked above; the examples are not in them)."""
    actions = {name: a for a in serve_actions() for name in a.option_strings}
    commands = docs_serve_commands()
    assert len(commands) > 10  # the extraction still finds the examples
    for where, words in commands:
        for i, word in enumerate(words):
            if not word.startswith("-") or re.fullmatch(r"-\d+", word):
                continue
            flag, _, inline = word.partition("=")
            assert flag in actions, f"{where}: serve takes no {flag}"
            action = actions[flag]
            if action.choices is not None:
                value = inline or words[i + 1]
                typed = action.type(value) if callable(action.type) else value
                assert typed in action.choices, (
                    f"{where}: {flag} {value} is not one of {list(action.choices)}"
                )


def test_help_and_docs_say_what_device_dependent_defaults_resolve_to() -> None:
    """--dtype auto and an unset step budget resolve by device (the budget also by the chunk size)."""
    from deltaserve.engine.config import EngineConfig

    helps = {a.dest: a.help or "" for a in serve_actions()}
    budget_default = next(d for names, _, d in docs_flag_rows() if "--max-num-batched-tokens" in names)
    for device, name in (("cuda", "CUDA"), ("cpu", "CPU")):
        config = EngineConfig(model="m", device=device)
        assert f"{config.dtype} on {name}" in helps["dtype"]  # not the checkpoint's dtype
        assert f"{config.max_num_batched_tokens} on {name}" in helps["max_num_batched_tokens"]
        larger = EngineConfig(model="m", device=device, chunked_prefill_size=16384)
        assert larger.max_num_batched_tokens == 16384
    assert "--chunked-prefill-size where that is larger" in helps["max_num_batched_tokens"]
    assert "`--chunked-prefill-size` where that is larger" in budget_default


def test_api_server_count_help_gives_each_default() -> None:
    """--help names each case of the unset count: CUDA with 8 cores, data-parallel engines, else one."""
    from deltaserve.server.api_servers import default_api_server_count

    helps = {a.dest: a.help or "" for a in serve_actions()}
    assert default_api_server_count("cuda", 8) == 2 and default_api_server_count("cuda", 7) == 1
    assert default_api_server_count("cuda", 32, engines=4) == 4 and default_api_server_count("cpu", 64) == 1
    assert "at least 8 cores 2, or one per data-parallel engine" in helps["api_server_count"]


def test_overlap_schedule_follows_the_device_unless_a_flag_says() -> None:
    from deltaserve.engine.config import EngineConfig

    parser = build_parser()
    flags = {
        (): None,
        ("--disable-overlap-schedule",): False,
        ("--enable-overlap-schedule",): True,
    }
    for extra, want in flags.items():
        assert parser.parse_args(["serve", *extra]).enable_overlap_schedule is want
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--disable-overlap-schedule", "--enable-overlap-schedule"])
    # unset: on where the GPU runs asynchronously, off on CPU
    assert EngineConfig(model="m", device="cuda").enable_overlap_schedule is True
    assert EngineConfig(model="m", device="cpu").enable_overlap_schedule is False
    assert (
        EngineConfig(model="m", device="cuda", enable_overlap_schedule=False).enable_overlap_schedule is False
    )


def test_enable_expert_parallel_reaches_the_engine_config(builtin_path: str) -> None:
    from deltaserve.server.launch import _engine_config

    parser = build_parser()
    base = ["serve", "--model", builtin_path, "--device", "cpu", "-tp", "2"]
    assert _engine_config(parser.parse_args(base)).enable_expert_parallel is False
    assert (
        _engine_config(parser.parse_args([*base, "--enable-expert-parallel"])).enable_expert_parallel is True
    )


def test_tokenizer_revision_picks_the_tokenizers_snapshot(
    builtin_path: str, tmp_path: Path, monkeypatch
) -> None:
    """vLLM's --tokenizer-revision: --tokenizer's repo at that revision, or without --tokenizer the
    model repo's tokenizer files at it (its weights staying at --revision)."""
    import huggingface_hub.constants

    from deltaserve.server.launch import _engine_config

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the cache only
    cache = tmp_path / "hub"
    for commit, ref in (("1" * 40, "main"), ("2" * 40, "v2")):  # the Hub cache's layout
        shutil.copytree(builtin_path, cache / "models--acme--tiny" / "snapshots" / commit)
        (cache / "models--acme--tiny" / "refs").mkdir(exist_ok=True)
        (cache / "models--acme--tiny" / "refs" / ref).write_text(commit)
    snapshot = str(cache / "models--acme--tiny" / "snapshots")
    parser = build_parser()
    base = ["serve", "--device", "cpu", "--download-dir", str(cache)]
    given = parser.parse_args(
        [*base, "--model", builtin_path, "--tokenizer", "acme/tiny", "--tokenizer-revision", "v2"]
    )
    assert _engine_config(given).tokenizer == f"{snapshot}/{'2' * 40}"
    assert _engine_config(
        parser.parse_args([*base, "--model", builtin_path, "--tokenizer", "acme/tiny"])
    ).tokenizer == (f"{snapshot}/{'1' * 40}")
    model_repo = _engine_config(
        parser.parse_args([*base, "--model", "acme/tiny", "--tokenizer-revision", "v2"])
    )
    assert model_repo.model == f"{snapshot}/{'1' * 40}" and model_repo.tokenizer == f"{snapshot}/{'2' * 40}"


def test_a_tokenizer_without_config_json_is_taken_as_vllm_takes_it(
    builtin_path: str, tmp_path: Path, monkeypatch
) -> None:
    """--tokenizer names a repo or folder of tokenizer files alone (tokenizer.json and
    tokenizer_config.json, no config.json), as vLLM loads one, where a repo without config.json
    stopped start-up ("is it a model repo?")."""
    import huggingface_hub.constants

    from deltaserve.server.launch import _engine_config

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the cache only
    folder, commit = tmp_path / "tok", "3" * 40
    snapshot = tmp_path / "hub" / "models--acme--tok" / "snapshots" / commit  # the Hub cache's layout
    for where in (folder, snapshot):
        where.mkdir(parents=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(builtin_path) / name, where / name)
    (tmp_path / "hub" / "models--acme--tok" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tok" / "refs" / "main").write_text(commit)
    base = ["serve", "--model", builtin_path, "--device", "cpu", "--download-dir", str(tmp_path / "hub")]
    parser = build_parser()
    assert _engine_config(parser.parse_args([*base, "--tokenizer", "acme/tok"])).tokenizer == str(snapshot)
    assert _engine_config(parser.parse_args([*base, "--tokenizer", str(folder)])).tokenizer == str(folder)


@pytest.mark.parametrize("given,dtype", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")])
def test_vllms_dtype_names_reach_the_engine_config(builtin_path: str, given: str, dtype: str) -> None:
    from deltaserve.server.launch import _engine_config

    args = build_parser().parse_args(["serve", "--model", builtin_path, "--device", "cpu", "--dtype", given])
    assert _engine_config(args).dtype == dtype


def test_vllms_safetensors_load_format_loads_the_weights(builtin_path: str) -> None:
    from deltaserve.server.launch import _engine_config

    args = ["serve", "--model", builtin_path, "--device", "cpu", "--load-format", "safetensors"]
    assert _engine_config(build_parser().parse_args(args)).load_format == "auto"


@pytest.mark.parametrize(
    "variable,typo,modes",
    [
        ("DELTASERVE_GEMV", "cuBLAS", ("auto", "cublas", "triton", "")),
        ("DELTASERVE_PDL", "yes", ("on", "off", "auto", "")),
        ("DELTASERVE_MLA_PREFILL", "flash", ("sdpa", "reference", "")),
        ("DELTASERVE_FAST_LAUNCH", "yes", ("auto", "0", "1", "")),
        ("DELTASERVE_FP8_DECODE", "fast", ("skinny", "gemm", "")),
        ("DELTASERVE_FLA_DIRECT", "off", ("0", "1", "")),
        ("DELTASERVE_REFERENCE_KERNELS", "true", ("0", "1", "")),
        ("DELTASERVE_GRAMMAR_TIMEOUT", "0", ("0.5", "300", "")),
        ("DELTASERVE_GRAMMAR_TIMEOUT", "5m", ("1e3",)),
    ],
)
def test_unknown_kernel_mode_is_a_start_up_error(monkeypatch, variable: str, typo: str, modes: tuple) -> None:
    from deltaserve.engine.config import EngineConfig

    monkeypatch.setenv(variable, typo)
    with pytest.raises(ValueError, match=variable):
        EngineConfig(model="m", device="cpu")
    for mode in modes:
        monkeypatch.setenv(variable, mode)
        EngineConfig(model="m", device="cpu")


@pytest.mark.slow
def test_unknown_gemv_mode_stops_serve_with_one_line() -> None:
    env = {**os.environ, "DELTASERVE_GEMV": "fast"}
    result = subprocess.run(
        [sys.executable, "-m", "deltaserve", "serve"], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and "DELTASERVE_GEMV" in lines[-1], result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, says",
    [
        (["-dp", "64", "--tp", "2", "--device", "cuda"], "needs GPUs up to cuda:127"),
        (["-dp", "2", "--tp", "2", "--nnodes", "2", "--master-port", "29555"], "more than one node"),
    ],
)
def test_replicas_that_cannot_run_stop_serve_with_one_line(args: list[str], says: str) -> None:
    result = run_cli("serve", "--port", "0", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and says in lines[-1], result.stderr


@pytest.mark.slow
def test_start_up_says_what_it_does(spawn_server, server, tmp_path: Path) -> None:
    """A first start builds the built-in model and says so once; loading shows a bar over the
    shards; the summary gives memory in GiB, the cache type and policy, and the prefill budget."""
    fresh = spawn_server(
        "--max-model-len",
        "256",
        "--max-num-batched-tokens",
        "384",
        "--chunked-prefill-size",
        "128",
        env={"DELTASERVE_CACHE": str(tmp_path / "cache")},
    )
    log = fresh.log()
    assert log.count("building the built-in model into") == 1
    assert "Loading safetensors shards" in log and "1/1" in log
    memory = re.search(
        r"memory: weights ([\d.]+) GiB, KV pool ([\d.]+) GiB, state pool ([\d.]+) GiB, "
        r"(\d+) snapshot slots ([\d.]+) GiB; ([\d.]+) GiB free",
        log,
    )
    assert memory is not None, log
    assert float(memory.group(1)) > 0 and float(memory.group(6)) > 0 and int(memory.group(4)) > 0
    assert "prefix cache: radix, policy marconi" in log
    assert "384 tokens a step (max_num_batched_tokens), 128 a request (chunked_prefill_size)" in log
    assert "building the built-in model" not in server.log()  # its cache already held it


def test_adaptive_prefill_delay_defaults_to_the_device_and_can_be_turned_off() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).adaptive_prefill_delay is None  # the engine picks by device
    assert parser.parse_args(["serve", "--no-adaptive-prefill-delay"]).adaptive_prefill_delay is False
    assert parser.parse_args(["serve", "--adaptive-prefill-delay"]).adaptive_prefill_delay is True


@pytest.mark.parametrize(
    "theirs,ours",
    [
        (["--max-num-seqs", "8"], ["--max-running-requests", "8"]),
        (["--gpu-memory-utilization", "0.7"], ["--mem-fraction-static", "0.7"]),
        (["--context-length", "4096"], ["--max-model-len", "4096"]),
        (["--tp-size", "2"], ["--tensor-parallel-size", "2"]),
        (["--tp", "2"], ["--tensor-parallel-size", "2"]),
        (["--enforce-eager"], ["--disable-cuda-graph"]),
        (["--block-size", "32"], ["--page-size", "32"]),
        (["--model-path", "."], ["--model", "."]),
        (["--no-enable-prefix-caching"], ["--cache-type", "naive"]),
        (["--disable-radix-cache"], ["--cache-type", "naive"]),
        (["--enable-prefix-caching"], ["--cache-type", "radix"]),
        (["--mamba-ssm-dtype", "bfloat16"], ["--state-dtype", "bfloat16"]),  # SGLang's
        (["--dp-size", "2"], ["--data-parallel-size", "2"]),  # SGLang's
        (["-dp", "2"], ["--data-parallel-size", "2"]),  # vLLM's
        (["--mamba-ssm-cache-dtype", "auto"], ["--state-dtype", "float32"]),  # vLLM's
        (["--max-cudagraph-capture-size", "64"], ["--cuda-graph-max-bs", "64"]),  # vLLM's
        (["--kv-cache-memory-bytes", str(3 * 2**29)], ["--pool-memory-gb", "1.5"]),  # vLLM's
        # the last one wins
        (["--cache-type", "naive", "--enable-prefix-caching"], ["--cache-type", "radix"]),
    ],
)
def test_vllm_and_sglang_names_set_what_ours_set(theirs: list[str], ours: list[str]) -> None:
    parser = build_parser()
    assert vars(parser.parse_args(["serve", *theirs])) == vars(parser.parse_args(["serve", *ours]))


@pytest.mark.parametrize(
    "flag,text,dest,value",
    [
        ("--max-model-len", "32k", "max_model_len", 32_000),  # lowercase: powers of 1000
        ("--max-model-len", "32K", "max_model_len", 32_768),  # uppercase: powers of 1024
        ("--max-model-len", "25.6k", "max_model_len", 25_600),
        ("--max-model-len", "1.001k", "max_model_len", 1_001),  # exact, where floats give 1000
        ("--max-model-len", "1m", "max_model_len", 1_000_000),
        ("--max-model-len", "1M", "max_model_len", 2**20),
        ("--max-model-len", "4096", "max_model_len", 4096),
        ("--context-length", "128K", "max_model_len", 2**17),  # SGLang's name of the same flag
        # vLLM's -1 and its alias auto (any case): the longest context the pools hold
        ("--max-model-len", "-1", "max_model_len", -1),
        ("--max-model-len", "auto", "max_model_len", -1),
        ("--max-model-len", "AUTO", "max_model_len", -1),
        ("--max-num-batched-tokens", "16k", "max_num_batched_tokens", 16_000),
        ("--max-num-batched-tokens", "8K", "max_num_batched_tokens", 8192),
        ("--kv-cache-memory-bytes", "2G", "pool_memory_gb", 2.0),
        ("--kv-cache-memory-bytes", "512M", "pool_memory_gb", 0.5),
        ("--kv-cache-memory-bytes", "2.147483648g", "pool_memory_gb", 2.0),
    ],
)
def test_vllms_human_readable_integers(flag: str, text: str, dest: str, value: float) -> None:
    """`vllm serve --max-model-len 32k` runs unchanged: the suffixes vLLM takes on these flags."""
    assert getattr(build_parser().parse_args(["serve", flag, text]), dest) == value


def test_a_binary_suffix_with_a_fraction_says_what_was_meant() -> None:
    result = run_cli("serve", "--max-model-len", "25.6K")
    assert "decimals are not allowed with binary suffixes like K" in result.stderr
    assert "did you mean 25.6k?" in result.stderr


def test_flags_for_what_deltaserve_does_anyway_change_nothing() -> None:
    """A model card's vLLM line, as Qwen's and Moonshot's cards give it, parses to the defaults."""
    parser = build_parser()
    card = [
        "--trust-remote-code", "--enable-chunked-prefill", "--enable-auto-tool-choice",
        "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3", "--kv-cache-dtype", "auto",
        "--enable-metrics", "--disable-log-requests", "--language-model-only", "--mm-encoder-tp-mode", "data",
        "--limit-mm-per-prompt", '{"image": 0, "video": 0}', "-dp", "1",
        "--pipeline-parallel-size", "1", "--distributed-executor-backend", "mp",
        "--enable-prompt-tokens-details", "--enable-reasoning",
    ]  # fmt: skip
    parsed, plain = vars(parser.parse_args(["serve", *card])), vars(parser.parse_args(["serve"]))
    compat = {"trust_remote_code", "enable_chunked_prefill", "enable_auto_tool_choice", "tool_call_parser",
              "reasoning_parser", "enable_metrics", "disable_log_requests", "language_model_only",
              "mm_encoder_tp_mode", "limit_mm_per_prompt", "distributed_executor_backend",
              "enable_prompt_tokens_details", "enable_reasoning"}  # fmt: skip
    assert {k: v for k, v in parsed.items() if k not in compat} == {
        k: v for k, v in plain.items() if k not in compat
    }
    # vLLM's newer object form of the media limits reads as its count
    newer = parser.parse_args(["serve", "--limit-mm-per-prompt", '{"image": {"count": 2, "width": 512}}'])
    assert newer.limit_mm_per_prompt == {"image": 2} and parsed["limit_mm_per_prompt"] == {
        "image": 0,
        "video": 0,
    }


def test_the_model_may_come_first_as_vllm_takes_it() -> None:
    from deltaserve.server.launch import _served_names

    parser = build_parser()
    args = parser.parse_args(["serve", "Qwen/Qwen3.5-9B", "--port", "9000"])
    assert args.model_tag == "Qwen/Qwen3.5-9B" and args.port == 9000
    args.model = args.model_tag
    assert _served_names(args) == (["Qwen/Qwen3.5-9B"], ["Qwen3.5-9B"])  # vLLM's name, and its last part
    result = run_cli("serve", "acme/one", "--model", "acme/two")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "acme/one" in result.stderr and "acme/two" in result.stderr


def test_a_repo_id_the_hub_cannot_give_stops_start_up_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "deltaserve", "serve", "acme/absent", "--port", "0"]
    cmd += ["--download-dir", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "'acme/absent'" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_server_of_a_repo_id_serves_it_under_that_name(
    spawn_server, builtin_path: str, tmp_path: Path
) -> None:
    """The built-in model as the Hub's cache holds a repo: the server finds it offline, lists the
    repo id as vLLM does, and answers the official client under it and under its last part."""
    import shutil

    from openai import OpenAI

    snapshot = tmp_path / "hub" / "models--acme--tiny-next" / "snapshots" / ("e" * 40)
    shutil.copytree(builtin_path, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("e" * 40)
    server = spawn_server(
        "acme/tiny-next", "--download-dir", str(tmp_path / "hub"), "--max-model-len", "256",
        "--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        env={"HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["acme/tiny-next"]
    for name in ("acme/tiny-next", "tiny-next"):
        out = client.completions.create(model=name, prompt="Hello", max_tokens=4, temperature=0)
        assert out.model == "acme/tiny-next" and out.usage.completion_tokens == 4
    assert str(snapshot) in server.log()


@pytest.mark.slow
def test_access_lines_can_be_turned_off(spawn_server, server) -> None:
    quiet = spawn_server("--disable-uvicorn-access-log", "--max-model-len", "256")
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    for s in (quiet, server):
        assert httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).status_code == 200
    assert '"POST /v1/completions HTTP/1.1" 200' in server.log()
    log = quiet.log()
    assert "uvicorn.access" not in log and "serving" in log  # the rest of the log stays


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    from deltaserve.server.text.chat_template import load_chat_template

    inline = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(inline)
    parser = build_parser()
    for given in (str(path), inline):
        assert (
            load_chat_template(parser.parse_args(["serve", "--chat-template", given]).chat_template) == inline
        )
    assert load_chat_template(None) is None


def test_a_chat_template_that_is_not_valid_jinja_stops_serve_with_one_line(tmp_path: Path) -> None:
    """Refused at start-up, where every chat request would get a 400; transformers' own tags
    ({% generation %}, {% break %}) and filters still pass."""
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    for given in (str(broken), "{% for m in messages %}{{ m.content }"):
        result = run_cli("serve", "--chat-template", given, "--port", "0")
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "argument --chat-template: not valid Jinja: unexpected '}'" in lines[0]
    fine = (
        "{% for m in messages %}{% generation %}{{ m.content | tojson }}{% endgeneration %}"
        "{% if loop.last %}{% break %}{% endif %}{% endfor %}"
    )
    assert build_parser().parse_args(["serve", "--chat-template", fine]).chat_template == fine


@pytest.mark.slow
def test_a_server_renders_with_a_template_given_inline(spawn_server) -> None:
    server = spawn_server(
        "--max-model-len",
        "256",
        "--chat-template",
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}",
    )
    rendered = httpx.post(
        f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30
    ).json()["tokens"]
    want = httpx.post(f"{server.url}/tokenize", json={"prompt": "[user] hi"}, timeout=30).json()["tokens"]
    assert rendered == want


def test_model_cards_speculative_lines_give_the_mtp_drafter() -> None:
    """Qwen's card (vLLM's method name) and SGLang's NEXTN flags both mean the checkpoint's MTP
    layer with that many drafts a step."""
    from deltaserve.engine.spec_decode.config import SpecConfig
    from deltaserve.server.cli import parse_args

    vllm = parse_args(
        ["serve", "--speculative-config", '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}']
    )
    assert SpecConfig.from_dict(vllm.speculative_config) == SpecConfig("mtp", 2)
    sglang = parse_args(
        ["serve", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk",
         "1", "--speculative-num-draft-tokens", "4"]
    )  # fmt: skip
    assert sglang.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    assert (
        parse_args(["serve", "--speculative-algorithm", "EAGLE"]).speculative_config["num_speculative_tokens"]
        == 1
    )


@pytest.mark.slow
def test_requests_are_logged_only_when_asked(spawn_server, server) -> None:
    """--enable-log-requests: one line a request with its prompt's first ids (--max-log-len) and the
    parameters it sets, none the server sets for itself; without the flag, no such line."""
    import ast

    import openai

    logged = spawn_server("--max-model-len", "256", "--enable-log-requests", "--max-log-len", "3")

    def request_lines(count: int) -> list[str]:
        """The log's request lines, once there are `count` of them (or the deadline passed)."""
        deadline = time.monotonic() + 30
        while True:
            lines = [line for line in logged.log().splitlines() if "prompt tokens" in line]
            if len(lines) >= count or time.monotonic() > deadline:
                return lines
            time.sleep(0.05)

    body = {"model": MODEL_NAME, "prompt": [5, 9, 17, 3, 88], "max_tokens": 3, "temperature": 0}
    for target in (logged, server):
        assert httpx.post(f"{target.url}/v1/completions", json=body, timeout=60).status_code == 200
    lines = request_lines(1)
    assert len(lines) == 1, lines
    assert "5 prompt tokens [5, 9, 17] ... (2 more)" in lines[0]
    assert ast.literal_eval(lines[0].split(", params ", 1)[1]) == {"max_tokens": 3, "temperature": 0.0}
    with openai.OpenAI(base_url=f"{logged.url}/v1", api_key="x", max_retries=0) as client:
        chat = [{"role": "user", "content": "hi"}]
        for stream in (False, True):
            reply = client.chat.completions.create(
                model=MODEL_NAME, messages=chat, max_tokens=2, temperature=0, stream=stream
            )
            if stream:
                list(reply)
    lines = request_lines(3)
    assert len(lines) == 3, lines
    for line in lines[1:]:  # a chat's prompt-cache hints and a stream's output form are the server's
        assert ast.literal_eval(line.split(", params ", 1)[1]) == {"max_tokens": 2, "temperature": 0.0}, line
    assert not [line for line in server.log().splitlines() if "prompt tokens [" in line]


@pytest.mark.slow
def test_a_server_on_a_unix_socket(spawn_server, tmp_path: Path) -> None:
    """--uds: the API on a Unix socket (through the openai client), nothing on the TCP port, and
    the socket file gone once the server stops."""
    import openai

    path = str(tmp_path / "deltaserve.sock")
    server = spawn_server("--max-model-len", "256", uds=path)
    with httpx.Client(transport=httpx.HTTPTransport(uds=path)) as http:
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=http, max_retries=0)
        r = client.completions.create(
            model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 2
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=2)
    assert server.stop() == 0 and not os.path.exists(path)


@pytest.mark.slow
def test_a_model_that_cannot_load_stops_start_up_with_its_error_last(builtin_path: str) -> None:
    """The engine process's load failure is the last line; no warning of what the engine process
    left behind follows it (the server waits for that process to clean up)."""
    result = run_cli("serve", "--model", builtin_path, "--port", "0", "--pool-memory-gb", "0.00001")
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "error" in last and "not enough memory for one request" in last, result.stderr
    assert "leaked" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_max_model_len_auto_serves_the_longest_context_the_pools_hold(spawn_server) -> None:
    """`--max-model-len auto` (vLLM's, -1 too) with pools too small for one request of the model's
    8,192 positions starts, lowered to the whole pages one request holds and logged, where the
    model's length stopped start-up with "not enough memory for one request"; a prompt past it
    gets vLLM's 400."""
    import openai

    server = spawn_server("--max-model-len", "auto", "--pool-memory-gb", "0.0002")
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert card["max_model_len"] == 624  # 39 pages of 16 tokens
    assert "max_model_len auto: lowered from 8192 to 624 tokens to fit in the pools" in server.log()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    r = client.completions.create(
        model=MODEL_NAME, prompt=[5] * 600, max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="624"):
        client.completions.create(model=MODEL_NAME, prompt=[5] * 620, max_tokens=8)


@pytest.mark.slow
def test_a_max_model_len_past_the_models_positions_stops_serve_before_it_loads(builtin_path: str) -> None:
    """One line and exit 2 from config.json, as vLLM refuses it, before the weights load."""
    result = run_cli("serve", "--model", builtin_path, "--port", "0", "--max-model-len", "100000")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "deltaserve serve: error: max_model_len 100000 is longer than the model's 8192 positions"
    ), result.stderr
    assert "loading the weights" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_tensor_parallel_size_the_heads_do_not_divide_stops_serve_before_any_rank(
    builtin_path: str,
) -> None:
    """One line and exit 2 from config.json: no rank starts, joins nor loads."""
    result = run_cli("serve", "--model", builtin_path, "--device", "cpu", "-tp", "3", "--port", "0")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "deltaserve serve: error: linear_num_key_heads (2) is not divisible by the tensor-parallel size 3"
    )
    for started in ("Traceback", "joined", "loading the weights", "rank"):
        assert started not in result.stderr.replace(last, ""), result.stderr


@pytest.mark.slow
def test_mtp_speculation_without_the_weights_stops_serve_before_it_loads(builtin_path: str) -> None:
    """One line and exit 2 from the safetensors headers, before the model's weights load."""
    mtp = '{"method": "mtp", "num_speculative_tokens": 1}'
    result = run_cli("serve", "--model", builtin_path, "--speculative-config", mtp, "--port", "0")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "deltaserve serve: error: the checkpoint has no mtp.* weights: MTP speculation needs them"
    assert "loading the weights" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", [(), ("--no-adaptive-prefill-delay",)])
def test_hold_prefill_tails_without_the_adaptive_delay_stops_serve(
    builtin_path: str, adaptive: tuple[str, ...]
) -> None:
    """The tails wait under the adaptive delay's rule; without it (CPU's default, or turned off) the
    flag would be taken and do nothing, so start-up refuses it with one line, before the weights load."""
    args = ("--model", builtin_path, "--device", "cpu", "--hold-prefill-tails", *adaptive, "--port", "0")
    result = run_cli("serve", *args)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("deltaserve serve: error: hold_prefill_tails"), result.stderr
    assert "--adaptive-prefill-delay" in last, result.stderr
    assert "loading the weights" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_tokenizer_folder_without_a_tokenizer_stops_serve_with_one_line(
    builtin_path: str, tmp_path: Path
) -> None:
    """Refused at start-up: without a tokenizer every text prompt would fail."""
    result = run_cli("serve", "--model", builtin_path, "--tokenizer", str(tmp_path), "--port", "0")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"deltaserve serve: error: --tokenizer {str(tmp_path)!r} holds no tokenizer files")
    assert "loading the weights" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("holding", [(), ("model.safetensors",)])
def test_a_model_folder_without_config_json_stops_serve_before_the_engine_starts(
    builtin_path: str, tmp_path: Path, holding: tuple[str, ...]
) -> None:
    """One line naming the folder and the file, exit 2 as the other start-up errors, where an engine
    process started and failed to load it (exit 1)."""
    for name in holding:
        shutil.copy(Path(builtin_path) / name, tmp_path / name)
    result = run_cli("serve", "--model", str(tmp_path), "--port", "0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"deltaserve serve: error: no config.json in {str(tmp_path)!r}: is it a Hugging Face checkpoint folder?"
    ]


@pytest.mark.slow
def test_an_engine_on_cpu_does_not_import_triton(builtin_path: str) -> None:
    """Triton is for CUDA kernels: a CPU engine neither pays for its import nor prints its
    bindings' leak report at exit."""
    code = (
        "import sys\nfrom deltaserve import LLM, SamplingParams\n"
        f"llm = LLM({builtin_path!r}, device='cpu')\n"
        "llm.generate('hi', SamplingParams(max_tokens=2))\n"
        "print('triton' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("False") and "nanobind" not in result.stderr, result.stderr
