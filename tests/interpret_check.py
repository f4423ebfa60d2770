"""The engine with its CUDA-path Triton kernels run by Triton's CPU interpreter, against the torch
reference path: greedy tokens must be identical (fp32). A wiring check for machines without a
GPU; it says nothing about speed or bf16, and pytest does not collect it.

    TRITON_INTERPRET=1 python tests/interpret_check.py qwen3_5
    TRITON_INTERPRET=1 python tests/interpret_check.py kimi --families norm,router,conv,moe,mla
    TRITON_INTERPRET=1 python tests/interpret_check.py qwen3_5 --spec   # + verification windows
    TRITON_INTERPRET=1 python tests/interpret_check.py qwen3_next --fuse-shared  # shared experts fused, as on CUDA
    TRITON_INTERPRET=1 python tests/interpret_check.py qwen3_5 --compile  # + Triton IR of each launch
    TRITON_INTERPRET=1 python tests/interpret_check.py qwen3_5 --compile --cubin  # + registers, spills

`--compile` also builds the Triton IR of every distinct kernel launch for sm_90 in a process
without the interpreter (`tests/triton_ir.py`): the interpreter does not type-check kernels the
way the compiler does, and a kernel that runs here can still fail to compile on the GPU.

Needs `triton` importable (the CPU torch wheel does not bring it). FLA's kernels (chunked
prefill, KDA) stay on the references. Families: norm (norms, gates, SwiGLU, KDA gate), linear
(the fused projections as one matmul, and the Triton GEMV), router, conv, attention, moe, mla,
gdn_decode, window (speculative verification windows: the Triton conv and GDN window kernels,
reached with `--spec`, n-gram speculation on repetitive prompts).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.modules["fla"] = None  # type: ignore[assignment]  # transformers' torch paths, as on CPU

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ALL = ["norm", "linear", "router", "conv", "attention", "moe", "mla", "gdn_decode", "window"]
MODULES = {
    "norm": ["deltaserve.kernels.norm"],
    "linear": ["deltaserve.kernels.linear", "deltaserve.models.layers.common"],
    "router": ["deltaserve.kernels.router"],
    "conv": ["deltaserve.kernels.conv"],
    "attention": ["deltaserve.kernels.attention"],
    "moe": ["deltaserve.kernels.moe"],
    "mla": ["deltaserve.kernels.mla"],
    "window": ["deltaserve.kernels.window"],
}


def checkpoint(kind: str) -> tuple[str, int]:
    import conftest

    path = tempfile.mkdtemp()
    if kind != "kimi":
        conftest._build(kind, path, seed=0)
        return path, conftest.TEXT["vocab_size"]
    conftest.build_kimi(path, conftest.KIMI)
    return path, int(conftest.KIMI["vocab_size"])


def use_fast(families: list[str]) -> None:
    fast = lambda t: True  # noqa: E731
    for family in families:
        for name in MODULES.get(family, []):
            importlib.import_module(name).use_fast_path = fast  # type: ignore[attr-defined]
    if "linear" in families:
        os.environ["DELTASERVE_GEMV"] = "triton"
    if "gdn_decode" in families:
        import deltaserve.engine.runner.linear_backend as lb
        from deltaserve.kernels.gdn.cuda import gdn_decode_cuda

        def gated(q, k, v, a, b, A_log, dt_bias, pool, slots):  # the kernel computes the gates
            return gdn_decode_cuda(q, k, v, a, b, pool, slots, gates=(A_log, dt_bias))

        lb.gdn_decode_gated = gated  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["qwen3_5", "qwen3_next", "qwen3_5_moe", "kimi"])
    ap.add_argument("--families", default=",".join(ALL))
    ap.add_argument("--spec", action="store_true", help="n-gram speculative decoding on repetitive prompts")
    ap.add_argument("--compile", action="store_true", help="also build each launch's Triton IR for sm_90")
    ap.add_argument(
        "--fuse-shared",
        action="store_true",
        help="the interpreted run's MoE shared experts fused, as on CUDA",
    )
    ap.add_argument(
        "--cubin", action="store_true", help="with --compile: on to the binary, registers and spills"
    )
    args = ap.parse_args()
    launches: set[str] = set()
    if args.compile:
        from triton_ir import record_launches

        record_launches(launches)
    from deltaserve import LLM, SamplingParams

    path, vocab = checkpoint(args.kind)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 7, 40, 70)]
    spec = None
    if args.spec:  # phrases repeated, so that n-gram drafts exist and get accepted
        prompts = [p[:5] * 6 for p in prompts[2:]] + [prompts[0] * 8]
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    params = SamplingParams(temperature=0, max_tokens=10 if args.spec else 6, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(path, dtype="float32", device="cpu", chunked_prefill_size=32, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if args.spec:
            print(f"accepted drafts: {sum(o.num_accepted_tokens for o in outs)}")
        return [o.outputs[0].token_ids for o in outs]

    ref = run()
    families = [f for f in args.families.split(",") if f]
    use_fast(families)
    if args.fuse_shared:
        from deltaserve.models.checkpoints import loader

        loader.SHARED_EXPERT_FUSION = ("cuda", "cpu")
    out = run()
    print(f"{args.kind} with {','.join(families)} interpreted: identical = {out == ref}")
    compiled = True
    if args.compile:
        import json
        import subprocess

        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump([json.loads(x) for x in sorted(launches)], f)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        compiled = (
            subprocess.run(
                [
                    sys.executable,
                    os.path.join(HERE, "triton_ir.py"),
                    f.name,
                    *(["--cubin"] if args.cubin else []),
                ],
                env=env,
            ).returncode
            == 0
        )
    sys.exit(0 if out == ref and compiled else 1)


if __name__ == "__main__":
    main()
