"""Dashboards: docs/grafana.json charts only metrics that a live server serves, and the few metrics
that vLLM's dashboards chart are there under vLLM's names with deltaserve's values."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana.json"
METRIC = re.compile(r"\b(?:deltaserve_|vllm:)[a-z0-9_:]+")

VLLM = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket",
    "vllm:request_inference_time_seconds_bucket",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
)


def queries(node: Any) -> list[str]:
    """Every PromQL string of the dashboard: panel targets' `expr` and template variables' queries."""
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
        return found + [q for k, v in node.items() for q in queries(v)]
    if isinstance(node, list):
        return [q for v in node for q in queries(v)]
    return []


def served_names(url: str) -> set[str]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"}


def test_every_metric_the_dashboard_charts_is_served(client, server) -> None:
    client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": -1}, timeout=10)
    assert bad.status_code == 400  # errors are counted by status from the first one on
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = queries(dashboard)
    charted = {name for e in exprs for name in METRIC.findall(e)}
    assert len(exprs) >= 20 and len(charted) >= 15
    assert "histogram_quantile" in " ".join(exprs)
    missing = charted - served_names(server.url)
    assert not missing, f"the dashboard charts metrics /metrics does not serve: {sorted(missing)}"


def test_vllm_names_carry_deltaserve_values(client, server, read_metrics, until_idle) -> None:
    client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    until_idle(server.url)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in VLLM:
        assert re.search(rf'^{re.escape(name)}{{model_name="{MODEL_NAME}"', text, re.M), name
    m = read_metrics(server.url)
    same = {
        "vllm:num_requests_running": "deltaserve_num_requests_running",
        "vllm:prompt_tokens_total": "deltaserve_prompt_tokens_total",
        "vllm:generation_tokens_total": "deltaserve_generation_tokens_total",
        "vllm:prefix_cache_queries_total": "deltaserve_prefix_cache_query_tokens_total",
        "vllm:prefix_cache_hits_total": "deltaserve_prefix_cache_hit_tokens_total",
        "vllm:time_to_first_token_seconds_count": "deltaserve_time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count": "deltaserve_e2e_request_latency_seconds_count",
    }
    for vllm, ours in same.items():
        assert m[vllm] == m[ours], vllm
    assert m["vllm:generation_tokens_total"] >= 4 and m["vllm:e2e_request_latency_seconds_count"] >= 1
    assert m["vllm:kv_cache_usage_perc"] == m["deltaserve_kv_pages_used"] / m["deltaserve_kv_pages_total"]
    assert 0.0 <= m["vllm:kv_cache_usage_perc"] <= 1.0


def test_each_finished_request_is_timed_by_phase_and_counted_by_tokens(
    server, read_metrics, until_idle
) -> None:
    """Three requests of known lengths: the request histograms gain three observations each, whose
    token sums are theirs, and whose phases fit inside one another."""
    until_idle(server.url)
    before = read_metrics(server.url)
    prompts = [[5, 9, 17], list(range(40, 60)), [7] * 33]
    for ids in prompts:
        body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 6, "ignore_eos": True}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    until_idle(server.url)
    after = read_metrics(server.url)

    def gained(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert gained(f"vllm:request_{phase}_time_seconds_count") == 3, phase
        assert gained(f"vllm:request_{phase}_time_seconds_sum") >= 0, phase
    assert gained("vllm:request_prompt_tokens_sum") == sum(len(p) for p in prompts)
    assert gained("vllm:request_generation_tokens_sum") == 3 * 6
    assert gained('vllm:request_success_total{finished_reason="length"}') == 3
    # from first scheduled to finish holds the prefill (to the first token) and the decode after it
    inference = gained("vllm:request_inference_time_seconds_sum")
    assert gained("vllm:request_prefill_time_seconds_sum") <= inference
    assert gained("vllm:request_decode_time_seconds_sum") <= inference
    assert gained("deltaserve_request_prompt_tokens_sum") == sum(len(p) for p in prompts)
    assert after["vllm:num_preemptions_total"] == after["deltaserve_num_preemptions_total"] == 0


def metric_families(names: set[str]) -> set[str]:
    """Served series names as the docs name them: a histogram by its name, not its `_bucket`, `_sum`, `_count`."""
    histograms = {n.removesuffix("_bucket") for n in names if n.endswith("_bucket")}
    return {n for n in names if re.sub(r"_(bucket|sum|count)$", "", n) not in histograms} | histograms


def metrics_table() -> tuple[str, list[tuple[str, list[str]]]]:
    """docs/api.md's Metrics section and its table's rows: each row's first name and its `/ _suffix`
    shorthands (`deltaserve_kv_pages_used` / `_total`)."""
    section = (DASHBOARD.parent / "api.md").read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `deltaserve_"):
            names = re.findall(r"`([a-z0-9_:]+)", line.split("|")[1])
            rows.append((names[0], [n for n in names[1:] if n.startswith("_")]))
    return section, rows


def completions(first: str, short: str) -> set[str]:
    """What a shorthand may complete to: the row's first name up to one of its underscores, then it."""
    return {first[:i] + short for i, c in enumerate(first) if c == "_"}


def test_docs_name_every_metric_served_and_serve_every_one_they_list(client, server) -> None:
    client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": -1}, timeout=10)
    assert bad.status_code == 400  # errors are counted by status from the first one on
    served = metric_families(served_names(server.url))
    section, rows = metrics_table()
    assert len(rows) >= 20
    spelled = {n for first, shorts in rows for s in shorts for n in completions(first, s)}
    undocumented = {m for m in served if m not in section and m not in spelled}
    assert not undocumented, f"/metrics serves metrics docs/api.md does not name: {sorted(undocumented)}"
    for first, shorts in rows:
        assert first in served, f"docs/api.md lists {first}, which /metrics does not serve"
        for short in shorts:
            assert completions(first, short) & served, f"docs/api.md lists {first} / {short}, not served"
