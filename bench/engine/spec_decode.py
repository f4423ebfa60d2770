"""Speculative decoding: per-request decode latency with and without drafts, and acceptance.

    python -m bench.engine.spec_decode --model configs/qwen3.5-0.8b --batch-sizes 1 16 \
        --num-speculative-tokens 3 --json out.json

Random weights do not continue text, so acceptance has to be arranged: the workload is
self-repeating prompts (a short random phrase repeated), and `--drafter` picks how drafts
are made:
- `ngram` (default): prompt lookup, as served; the acceptance rate is whatever the random
  model's own greedy output gives (random models often fall into loops, which n-gram drafts
  catch);
- `oracle`: the plain run's greedy continuation, right for `--oracle-right` tokens then
  wrong: verification cost at a known accepted length;
- `mtp`: the checkpoint's MTP layer (Qwen3-Next / Qwen3.5; random here, so it measures the
  drafting cost, not a speedup).
Both runs use one engine (speculation switched off for the plain one) and greedy sampling,
so their outputs must agree: the script checks it. Decode latency counts only the steps after
every prompt is prefilled. Steps with verification windows run eagerly (no CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class OracleDrafter:
    """The true greedy continuation for `right` tokens, then a wrong token."""

    def __init__(self, sequences: list[list[int]], right: int, vocab: int) -> None:
        self.sequences, self.right, self.vocab = sequences, right, vocab

    def propose(self, tokens: list[int], k: int) -> list[int]:
        seq = next((s for s in self.sequences if s[: len(tokens)] == tokens), None)
        if seq is None:
            return []
        cont = seq[len(tokens) :]
        drafts = cont[: min(self.right, k)]
        if len(drafts) < k and len(cont) > len(drafts):
            drafts.append((cont[len(drafts)] + 1) % self.vocab)
        return drafts


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def repetitive_prompts(bs: int, prompt_len: int, phrase_len: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(bs)
    out = []
    for _ in range(bs):
        phrase = torch.randint(0, vocab, (phrase_len,), generator=gen).tolist()
        out.append((phrase * (prompt_len // phrase_len + 1))[:prompt_len])
    return out


def run_batch(
    engine: Engine, prompts: list[list[int]], new_tokens: int, tag: str
) -> tuple[dict, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    before = dict(engine.counters)
    done = {rid: len(r.output_token_ids) for rid, r in engine.requests.items()}
    outputs: dict[str, list[int]] = {}
    steps = 0
    _sync()
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o.outputs[0].token_ids
        steps += 1
    _sync()
    dt = time.perf_counter() - t
    decoded = sum(len(outputs[rid]) - n for rid, n in done.items())
    drafts = engine.counters["spec_draft_tokens_total"] - before["spec_draft_tokens_total"]
    accepted = engine.counters["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
    windows = engine.counters["spec_windows_total"] - before["spec_windows_total"]
    row = {
        "batch": len(prompts),
        "steps": steps,
        "ms_per_token": 1e3 * dt * len(prompts) / max(decoded, 1),  # per request: decode latency
        "tok_s": decoded / dt,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_accepted_length": 1 + accepted / windows if windows else 1.0,
    }
    return row, [outputs[f"{tag}-{i}"] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a folder with config.json (configs/...)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--phrase-len", type=int, default=16, help="the repeated phrase's length")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument(
        "--drafter",
        choices=["ngram", "oracle", "mtp"],
        default="ngram",
        help="mtp: the model's own MTP layer (random weights here: acceptance near zero, cost only)",
    )
    ap.add_argument("--oracle-right", type=int, default=2, help="oracle: right drafts per window")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument(
        "--verify-graphs",
        action="store_true",
        help="speculative_config cuda_graph: uniform k-draft windows replayed from CUDA graphs",
    )
    ap.add_argument(
        "--reference-windows",
        action="store_true",
        help="verification windows on their torch references instead of the Triton conv / GDN window "
        "kernels (the before of a before/after)",
    )
    ap.add_argument("--device", default="cuda", help="cpu only for a quick dry run of the script")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    if args.reference_windows:
        import deltaserve.kernels.window as window_ops

        window_ops.use_fast_path = lambda t: False  # type: ignore[assignment]
    max_bs = max(args.batch_sizes)
    spec = {
        "method": "mtp" if args.drafter == "mtp" else "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "cuda_graph": args.verify_graphs,
    }
    engine = Engine(
        EngineConfig(
            model=args.model,
            load_format="dummy",
            dtype=args.dtype,
            device=args.device,
            cache_type="naive",  # every run computes its prompts: no help from the previous one
            max_running_requests=max_bs,
            max_model_len=args.prompt_len + args.new_tokens + 16,
            disable_cuda_graph=args.disable_cuda_graph,
            speculative_config=spec,
        )
    )
    assert engine.spec is not None
    vocab = int(engine.model_config.vocab_size)
    propose = engine.scheduler.propose
    result: dict = {
        "model": args.model,
        "device": args.device,
        "spec": spec,
        "drafter": args.drafter,
        "rows": [],
    }
    warm = repetitive_prompts(1, 32, 8, vocab)
    run_batch(engine, warm, 4, "warm")  # first-call costs (allocations, kernel compiles)
    for bs in args.batch_sizes:
        prompts = repetitive_prompts(bs, args.prompt_len, args.phrase_len, vocab)
        mtp, engine.spec.mtp = engine.spec.mtp, None  # no drafting work at all in the plain run
        engine.scheduler.propose = None
        plain, plain_out = run_batch(engine, prompts, args.new_tokens, f"plain{bs}")
        engine.scheduler.propose, engine.spec.mtp = propose, mtp
        if args.drafter == "oracle":
            seqs = [p + o for p, o in zip(prompts, plain_out)]
            engine.spec.drafter = OracleDrafter(seqs, args.oracle_right, vocab)
        sped, spec_out = run_batch(engine, prompts, args.new_tokens, f"spec{bs}")
        row = {
            "batch": bs,
            "plain_ms_per_token": plain["ms_per_token"],
            "spec_ms_per_token": sped["ms_per_token"],
            "speedup": plain["ms_per_token"] / sped["ms_per_token"],
            "acceptance_rate": sped["acceptance_rate"],
            "mean_accepted_length": sped["mean_accepted_length"],
            "draft_tokens": sped["draft_tokens"],
            "accepted_tokens": sped["accepted_tokens"],
            # bf16 kernels may round differently on the verification path: report, don't fail.
            # Once a request's output leaves the plain run's, the oracle has nothing to propose
            # (uniform windows then verify k padding drafts, nearly all rejected)
            "outputs_identical": spec_out == plain_out,
            "mean_first_divergence": sum(map(first_divergence, spec_out, plain_out)) / bs,
        }
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
