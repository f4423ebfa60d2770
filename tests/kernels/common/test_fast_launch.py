"""The cached Triton launch path's key and wrapping, on CPU (no launch happens here: the GPU
tests hold cached launches to Triton's own path, tests/kernels/test_cuda_kernels.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from deltaserve.kernels.common.fast_launch import fast_launch, fast_launch_enabled, fast_launch_module


@pytest.fixture(autouse=True)
def _on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTASERVE_FAST_LAUNCH", "1")  # whatever this machine's Triton version


def _kernel() -> JITFunction:
    # a fresh JIT function per test: fast_launch changes the object in place
    @triton.jit
    def k(x, y, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr):
        pass

    return k


def _key(kernel: object, **call: object) -> tuple[object, ...] | None:
    return kernel._deltaserve_plan.key(call, 0)  # type: ignore[attr-defined]


def _args(**over: object) -> dict[str, object]:
    base = {"x": torch.zeros(64), "y": torch.zeros(64, dtype=torch.int32), "n": 7, "scale": 0.5, "BLOCK": 32}
    return {**base, **over}


def test_wrapping_keeps_the_object_and_its_type() -> None:
    k = _kernel()
    same = fast_launch(k)
    assert same is k and isinstance(k, JITFunction) and type(k).__name__ == "JITFunction"
    assert type(k) is not JITFunction  # the subclass with the cached path
    assert fast_launch(k) is k and type(k).__mro__[1] is JITFunction  # wrapping twice changes nothing


def test_the_key_separates_what_triton_specializes_on() -> None:
    k = fast_launch(_kernel())
    base = _key(k, **_args())
    assert base is not None and base == _key(k, **_args())
    # another tensor of the same dtype and alignment, another int of the same class, another float
    assert _key(k, **_args(x=torch.ones(128), n=9, scale=3.0)) == base
    # what changes the compiled kernel: dtype, alignment, ints 1 / multiples of 16 / wide, constexprs
    different = [
        _args(x=torch.zeros(64, dtype=torch.float16)),
        _args(x=torch.zeros(65)[1:]),  # 4 bytes past an aligned start
        _args(n=1),
        _args(n=32),
        _args(n=2**40),
        _args(BLOCK=64),
        _args(scale=None),
        {**_args(), "num_warps": 8},
        {**_args(), "FLAG": True},
    ]
    keys = [_key(k, **call) for call in different]
    assert all(key is not None and key != base for key in keys)
    assert len(set(keys)) == len(keys)
    # the same values under other names are another call
    assert (
        _key(
            k,
            **{
                "y": torch.zeros(64),
                "x": torch.zeros(64, dtype=torch.int32),
                "n": 7,
                "scale": 0.5,
                "BLOCK": 32,
            },
        )
        != base
    )


def test_autotune_keys_are_exact_and_heuristics_are_computed() -> None:
    inner = _kernel()
    tuned = triton.autotune(
        configs=[triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)], key=["n"]
    )(inner)
    k = fast_launch(triton.heuristics({"FLAG": lambda a: a["scale"] is not None and a["scale"] > 1})(tuned))
    assert hasattr(k, "_deltaserve_plan")
    base = _key(k, **_args(n=7))
    assert _key(k, **_args(n=9)) != base  # n is the tuning key: its exact value picks the config
    assert _key(k, **_args(n=7, scale=2.0)) != base  # the heuristic's output differs
    assert _key(k, **_args(n=7, scale=0.25)) == base
    assert _key(k, **_args(n=torch.zeros(1))) is None  # a tensor where an exact value is needed


def test_chains_it_cannot_key_keep_tritons_path() -> None:
    hook_config = triton.Config({}, num_warps=4, pre_hook=lambda args: None)
    with_hook = triton.autotune(configs=[hook_config, triton.Config({}, num_warps=8)], key=["n"])(_kernel())
    assert fast_launch(with_hook) is with_hook and not hasattr(with_hook, "_deltaserve_plan")
    # a heuristic below the autotuner may read its choice
    below = triton.heuristics({"FLAG": lambda a: True})(_kernel())
    outer = triton.autotune(configs=[triton.Config({}, num_warps=4)], key=["n"])(below)
    assert not hasattr(fast_launch(outer), "_deltaserve_plan")


def test_switch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTASERVE_FAST_LAUNCH", "0")
    k = _kernel()
    assert fast_launch(k) is k and type(k) is JITFunction


@pytest.mark.parametrize(
    ("version", "on"), [("3.5.1", False), ("3.6.0", True), ("3.9.0", True), ("3.10.0", False)]
)
def test_default_follows_the_triton_versions_checked(
    monkeypatch: pytest.MonkeyPatch, version: str, on: bool
) -> None:
    monkeypatch.setenv("DELTASERVE_FAST_LAUNCH", "auto")
    monkeypatch.setattr(triton, "__version__", version)
    assert fast_launch_enabled() is on
    monkeypatch.setenv("DELTASERVE_FAST_LAUNCH", "on")
    with pytest.raises(ValueError, match="DELTASERVE_FAST_LAUNCH"):
        fast_launch_enabled()


def test_a_recorded_launch_keeps_the_kernel_and_constants_not_the_calls_tensors() -> None:
    """The first call of a kind takes Triton's path (a stand-in `run` here: no GPU) and records
    its last launch: the compiled kernel, and the values the wrappers chose (a heuristic's
    output); what each call passes is read from the call, and the recorded call's tensors are
    not kept alive (they would hold device memory for as long as the process runs)."""
    import gc
    import weakref

    from deltaserve.kernels.common.fast_launch import _launch_recording

    k = fast_launch(triton.heuristics({"FLAG": lambda a: a["n"] > 3})(_kernel()))
    plan = k._deltaserve_plan
    runs: list[bool] = []

    def tritons_run(*a: object, grid: object, warmup: bool, **kw: object) -> str:
        runs.append(kw["FLAG"])  # type: ignore[arg-type]
        return "compiled"

    plan.jit.run = tritons_run  # what Triton's JITFunction.run would be, for the hook to wrap
    x = torch.zeros(64)
    alive = weakref.ref(x)
    call = _args(x=x, n=7)
    key = plan.key(call, 0)
    assert _launch_recording(plan, k._deltaserve_base, k, (1,), (), call, dict(call), key) == "compiled"
    assert runs == [True] and "run" not in vars(plan.jit)  # the hook is gone again
    entry = plan.entries[key]
    assert entry.kernel == "compiled"
    template = {name: (from_call, value) for name, from_call, value in entry.template}
    assert template["x"] == (True, None) and template["n"] == (True, None)
    assert template["FLAG"] == (False, True)  # the heuristic's choice, recorded
    del x, call
    gc.collect()
    assert alive() is None


def test_no_triton_installed_means_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU install (torch's CPU wheel brings no Triton) starts: the engine's config check of the
    switch must not need Triton (the README's `pip install . && deltaserve serve`)."""
    import sys

    from deltaserve.engine.config import EngineConfig

    monkeypatch.setenv("DELTASERVE_FAST_LAUNCH", "auto")
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    assert fast_launch_enabled() is False
    EngineConfig(model="unused", device="cpu")


def test_our_kernel_modules_take_it() -> None:
    from deltaserve.kernels.norm import triton as norm_triton

    fast_launch_module(norm_triton)  # a no-op where its import did it (this Triton is one checked)
    assert hasattr(norm_triton._rms_norm_kernel, "_deltaserve_plan")
    assert fast_launch_module(norm_triton) == 0
