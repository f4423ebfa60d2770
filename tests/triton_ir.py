"""Build the Triton IR of kernel launches for an NVIDIA target, on a machine without a GPU.

Triton's CPU interpreter runs kernels without type-checking them the way the compiler does
(a name assigned in both branches of an `if` with different shapes runs under the interpreter
and fails to compile), so `tests/interpret_check.py --compile` records every distinct launch
the interpreted engine makes and hands them to this module, which builds each one's Triton IR
(`ASTSource.make_ir`, the compiler's frontend, for sm_90) in a process without
`TRITON_INTERPRET`. Nothing runs on a GPU; code generation past the IR is not checked.

    python tests/triton_ir.py LAUNCHES.json [--debug]  # written by interpret_check.py --compile

`--debug` prints each failure's whole traceback (the compiler's message is in its last lines).
`--cubin` goes on to the sm_90 binary (Triton's whole pipeline and the wheel's own `ptxas`, still
no GPU) and reports each launch's registers and spilled bytes, as `ptxas -v` counts them.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

_DTYPES = {
    "torch.float32": "fp32",
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.int64": "i64",
    "torch.int32": "i32",
    "torch.int16": "i16",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.bool": "i1",
    "torch.float8_e4m3fn": "fp8e4nv",
}


def describe(value: Any) -> list:
    """A launch argument as JSON: its kind and what the compiler specialises on."""
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype)]
    if isinstance(value, bool):
        return ["bool", value]
    if isinstance(value, int):
        return ["int", value]
    if isinstance(value, float):
        return ["float", value]
    if isinstance(value, str):
        return ["str", value]
    if value is None:
        return ["none"]
    import triton.language as tl

    if isinstance(value, tl.dtype):  # a constexpr dtype (what a kernel rounds to, say)
        return ["tl.dtype", value.name]
    return ["other", repr(value)]


def record_launches(seen: set[str]) -> None:
    """Under TRITON_INTERPRET: note every launch's kernel and argument kinds in `seen`."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        bound = dict(zip(self.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in self.arg_names})
        launch = {
            "module": self.fn.__module__,
            "name": self.fn.__qualname__,
            "args": {name: describe(value) for name, value in bound.items()},
            "options": {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs},
        }
        seen.add(json.dumps(launch, sort_keys=True))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording  # type: ignore[method-assign]


def build_ir(launches: list[dict]) -> list[str]:
    """Build each launch's Triton IR for sm_90; the failures, one line each."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    failures = []
    for launch in launches:
        fn: Any = getattr(importlib.import_module(launch["module"]), launch["name"])
        while not isinstance(fn, JITFunction):  # autotuner / heuristics wrappers
            fn = fn.fn
        signature, constexprs = {}, {}
        for i, param in enumerate(fn.params):
            kind = launch["args"].get(param.name)
            if param.is_constexpr or kind is None or kind[0] == "none":
                value = param.default if kind is None else (kind[1] if len(kind) > 1 else None)
                if kind is not None and kind[0] == "tl.dtype":
                    value = tl.dtype(kind[1])
                signature[param.name] = "constexpr"
                constexprs[(i,)] = value
            elif kind[0] == "tensor":
                signature[param.name] = "*" + _DTYPES[kind[1]]
            elif kind[0] == "bool":
                signature[param.name] = "i1"
            elif kind[0] == "int":
                signature[param.name] = "i64" if abs(kind[1]) >= 2**31 else "i32"
            elif kind[0] == "float":
                signature[param.name] = "fp32"
            else:
                failures.append(f"{launch['name']}: cannot type argument {param.name} ({kind[1]})")
                break
        else:
            context = triton._C.libtriton.ir.context()
            triton._C.libtriton.ir.load_dialects(context)
            backend.load_dialects(context)
            source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            try:
                source.make_ir(
                    target,
                    options,
                    backend.get_codegen_implementation(options),
                    backend.get_module_map(),
                    context,
                )
                if "--cubin" in sys.argv:
                    usage = ptxas_usage(source, target, launch.get("options", {}))
                    print(f"  {launch['name']} {_constexprs(fn, constexprs)}: {usage}")
            except Exception as e:  # the compiler's own message: what the interpreter let through
                if "--debug" in sys.argv:
                    import traceback

                    traceback.print_exc()
                failures.append(f"{launch['module']}.{launch['name']}: {str(e).strip()[-600:]}")
    return failures


def _constexprs(fn: Any, constexprs: dict) -> str:
    return ", ".join(
        f"{fn.params[i].name}={v}" for (i,), v in constexprs.items() if fn.params[i].name.isupper()
    )


def ptxas_usage(source: Any, target: Any, options: dict) -> str:
    """The launch built to an sm_90 binary: `ptxas -v`'s registers and spill line."""
    import os
    import subprocess
    import tempfile

    import triton

    kernel = triton.compile(source, target=target, options=options)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        # a wheel's `ptxas` can be older than the PTX its compiler writes; its newer one then reads it
        tools = [
            os.path.join(bin_dir, n)
            for n in ("ptxas", "ptxas-blackwell")
            if os.path.exists(os.path.join(bin_dir, n))
        ]
        for tool in tools:
            done = subprocess.run(
                [tool, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True
            )
            if done.returncode == 0:
                break
        else:
            return "no ptxas here reads this PTX"
    lines = done.stderr.splitlines()
    usage = "; ".join(line.split("info    : ")[-1] for line in lines if "Used" in line or "spill" in line)
    return f"{usage}; {kernel.metadata.shared} bytes of shared memory"


def main() -> None:
    with open(sys.argv[1]) as f:
        launches = json.load(f)
    failures = build_ir(launches)
    print(f"Triton IR for sm_90: {len(launches) - len(failures)} of {len(launches)} kernel launches built")
    for line in failures:
        print("  FAILED", line)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
