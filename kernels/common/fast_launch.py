"""Triton launches that skip Triton's per-call Python work once a call's kind has been seen.

`kernel[grid](...)` passes through Triton's heuristics and autotuner wrappers (a dict of the
arguments per wrapper, the tuning key with `str(dtype)` per tensor) and then `JITFunction.run`
(the binder, the compiled-kernel key, globals checks). A small model's eager prefill step makes
about 300 such launches and is bound by its host work (docs/performance.md, "Environment
switches", has what this path measured).

`fast_launch(kernel)` gives the kernel object a launch path with a cache: the first call of a
kind takes Triton's own path, which picks the configuration and compiles, while a hook on the
innermost `JITFunction.run` records what it launched. Later calls of that kind launch the
recorded compiled kernel directly. A call's kind is a key finer than every choice Triton makes
from the arguments:
- exact values of constexpr parameters, autotuning keys and launch options (`num_warps`, ...);
- the outputs of the kernel's heuristics, computed from the arguments;
- for tensors, the dtype and whether the pointer is 16-byte aligned (Triton's specialization);
- for other integers, whether the value is 1, divisible by 16, and its integer width;
- None for None, the type for floats, the device.
So a cached launch runs the same compiled kernel with the same configuration that Triton's path
would: the tests hold the two to identical outputs. Kernels whose configurations carry pre-hooks,
or whose heuristics read the autotuner's choice, keep Triton's path.

The object stays the same object (its class is swapped for a subclass with this `__getitem__`),
so Triton functions that call it from device code, and Triton's checks of their globals, are
unaffected. `DELTASERVE_FAST_LAUNCH=0` turns it off (`fast_launch_enabled`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from deltaserve.kernels.common.launch import env_mode

_plain = False  # `plain_launches()`: every launch takes Triton's path
_MAX_ENTRIES = 4096  # kinds per kernel; beyond it, calls take Triton's path (a guard, not a tuning)
_I32 = (-(2**31), 2**31)


# Triton versions whose internals this module uses as it expects: 3.6 runs on the GPU machine
# (tests/kernels/test_cuda_kernels.py), 3.9's source has the same calls; others default to off
_TRITON_CHECKED = ((3, 6), (3, 9))


def fast_launch_mode() -> str:
    """`DELTASERVE_FAST_LAUNCH` as set (a typo is a ValueError), without importing Triton."""
    return env_mode("DELTASERVE_FAST_LAUNCH", ("auto", "0", "1"), "auto")


def fast_launch_enabled() -> bool:
    """`DELTASERVE_FAST_LAUNCH`: 1 on, 0 off, auto (default) on for the Triton versions checked."""
    mode = fast_launch_mode()
    if mode != "auto":
        return mode == "1"
    try:
        import triton
    except ImportError:  # a CPU install without Triton: nothing to launch
        return False
    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    return _TRITON_CHECKED[0] <= version <= _TRITON_CHECKED[1]


class _Entry:
    __slots__ = ("kernel", "template", "hits")

    def __init__(self, kernel: Any, template: list[tuple[str, bool, Any]]) -> None:
        self.kernel = kernel
        self.template = template  # per JIT parameter: (name, from the call?, recorded value)
        self.hits = 0


class _Plan:
    """What one kernel object's chain of wrappers needs for the fast path, found once."""

    def __init__(self, kernel: Any) -> None:
        from triton.runtime.autotuner import Autotuner, Heuristics
        from triton.runtime.jit import JITFunction

        self.ok = True
        self.heuristics: list[tuple[str, Callable[[dict[str, Any]], Any]]] = []
        exact: set[str] = set()
        overridden: set[str] = set()
        seen_autotuner = False
        node = kernel
        while not isinstance(node, JITFunction):
            if isinstance(node, Autotuner):
                seen_autotuner = True
                exact.update(node.keys)
                for config in node.configs:
                    overridden.update(config.kwargs)
                    self.ok &= config.pre_hook is None
            elif isinstance(node, Heuristics):
                # below an autotuner a heuristic may read its choice, which the key cannot see
                self.ok &= not seen_autotuner
                self.heuristics.extend(node.values.items())
                overridden.update(node.values)
            else:
                self.ok = False
                break
            node = node.fn
        self.jit = node if isinstance(node, JITFunction) else None
        if self.jit is None:
            self.ok = False
            return
        self.ok &= not self.jit.pre_run_hooks
        self.arg_names: list[str] = list(self.jit.arg_names)
        self.params = set(self.arg_names)
        self.exact = exact | {p.name for p in self.jit.params if p.is_constexpr}
        self.overridden = overridden
        self.entries: dict[tuple[Any, ...], _Entry] = {}
        self.get_stream: Callable[[int], int] | None = None  # Triton's, found at the first launch
        self.hooks: Any = None  # triton.knobs.runtime, likewise

    def key(self, d: dict[str, Any], device: int) -> tuple[Any, ...] | None:
        """The call's kind (see the module's docstring), or None for a call it cannot key (a
        tensor where an exact value is needed; an unhashable value fails the lookup instead)."""
        parts: list[Any] = [device, tuple(d)]  # the names: which value is which
        exact, params = self.exact, self.params
        for name, v in d.items():
            if name in exact or name not in params:
                if isinstance(v, torch.Tensor):
                    return None
                parts.append((name, v))
            elif isinstance(v, torch.Tensor):
                parts.append((v.dtype, v.data_ptr() % 16 == 0))
            elif v is None or isinstance(v, bool):
                parts.append(v)
            elif isinstance(v, int):
                parts.append((v == 1, v % 16 == 0, _I32[0] <= v < _I32[1], v < 2**63))
            elif isinstance(v, float):
                parts.append(float)
            else:
                parts.append((name, v))
        if self.heuristics:
            h = dict(d)
            for name, fn in self.heuristics:
                h[name] = fn(h)
                parts.append(h[name])
        return tuple(parts)


def _launch_cached(plan: _Plan, entry: _Entry, grid: Any, d: dict[str, Any], device: int) -> Any:
    vals = [d[name] if from_call else value for name, from_call, value in entry.template]
    if callable(grid):
        grid = grid(dict(zip(plan.arg_names, vals)))
    n = len(grid)
    g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
    if plan.get_stream is None:  # Triton's stream getter and launch hooks, looked up once
        from triton import knobs
        from triton.runtime.driver import driver

        plan.get_stream, plan.hooks = driver.active.get_current_stream, knobs.runtime
    stream = plan.get_stream(device)
    k = entry.kernel
    entry.hits += 1
    meta = k.launch_metadata(grid, stream, *vals)
    hooks = plan.hooks  # its attributes are read per launch: a profiler may set them later
    k.run(
        g0,
        g1,
        g2,
        stream,
        k.function,
        k.packed_metadata,
        meta,
        hooks.launch_enter_hook,
        hooks.launch_exit_hook,
        *vals,
    )
    return k


def _launch_recording(
    plan: _Plan,
    base: Any,
    kernel: Any,
    grid: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    d: dict[str, Any],
    key: tuple[Any, ...] | None,
) -> Any:
    """Triton's own path, recording its last launch (the one after any autotuning) under `key`."""
    jit = plan.jit
    assert jit is not None
    launches: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = []
    run = jit.run

    def record(*a: Any, grid: Any, warmup: bool, **kw: Any) -> Any:
        k = run(*a, grid=grid, warmup=warmup, **kw)
        if not warmup and k is not None:  # None: Triton launched nothing to record
            launches.append((a, kw, k))
        return k

    jit.run = record
    try:
        result = base.__getitem__(kernel, grid)(*args, **kwargs)
    finally:
        del jit.run
    if key is not None and launches and len(plan.entries) < _MAX_ENTRIES:
        a, kw, k = launches[-1]
        k = k.result() if hasattr(k, "result") else k
        bound = jit.signature.bind(*a, **{n: v for n, v in kw.items() if n in plan.params})
        bound.apply_defaults()
        # what comes from each call keeps no value here: the recorded call's tensors would stay alive
        from_call = [name in d and name not in plan.overridden for name in plan.arg_names]
        template = [
            (name, call, None if call else bound.arguments[name])
            for name, call in zip(plan.arg_names, from_call)
        ]
        plan.entries[key] = _Entry(k, template)
    return result


def _fast_getitem(self: Any, grid: Any) -> Callable[..., Any]:
    plan: _Plan = self._deltaserve_plan
    base = self._deltaserve_base

    def launch(*args: Any, **kwargs: Any) -> Any:
        if _plain:
            return base.__getitem__(self, grid)(*args, **kwargs)
        d = dict(zip(plan.arg_names, args)) if args else {}
        d.update(kwargs)
        device = torch.cuda.current_device()
        key = plan.key(d, device)
        try:
            entry = plan.entries.get(key) if key is not None else None
        except TypeError:  # an unhashable argument: Triton's path, unrecorded
            key = entry = None
        if entry is not None:
            return _launch_cached(plan, entry, grid, d, device)
        return _launch_recording(plan, base, self, grid, args, kwargs, d, key)

    return launch


@contextmanager
def plain_launches() -> Iterator[None]:
    """Inside, every launch takes Triton's own path (the tests compare the two)."""
    global _plain
    previous, _plain = _plain, True
    try:
        yield
    finally:
        _plain = previous


def cached_launches(kernel: Any) -> int:
    """How many of `kernel`'s launches took the cached path so far."""
    plan = getattr(kernel, "_deltaserve_plan", None)
    return sum(e.hits for e in plan.entries.values()) if plan is not None else 0


_subclasses: dict[type, type] = {}


def fast_launch(kernel: Any) -> Any:
    """`kernel` (a Triton JIT function, or its heuristics/autotuner wrapper) with the cached
    launch path, in place; unchanged where its chain is not one this module can key, or with
    DELTASERVE_FAST_LAUNCH=0. Returns the same object."""
    if not fast_launch_enabled() or hasattr(kernel, "_deltaserve_plan"):
        return kernel
    plan = _Plan(kernel)
    if not plan.ok:
        return kernel
    base = type(kernel)
    sub = _subclasses.get(base)
    if sub is None:
        # the same name: Triton serializes JIT functions passed as constants by class name
        sub = type(base.__name__, (base,), {"__getitem__": _fast_getitem, "__module__": base.__module__})
        _subclasses[base] = sub
    kernel._deltaserve_plan = plan
    kernel._deltaserve_base = base
    kernel.__class__ = sub
    return kernel


def fast_launch_module(module: ModuleType | str) -> int:
    """`fast_launch` on every Triton kernel object bound at module level; how many took it."""
    from triton.runtime.jit import KernelInterface

    mod = sys.modules[module] if isinstance(module, str) else module
    count = 0
    for value in list(vars(mod).values()):
        if isinstance(value, KernelInterface) and not hasattr(value, "_deltaserve_plan"):
            count += hasattr(fast_launch(value), "_deltaserve_plan")
    return count


def fast_launch_modules(prefix: str) -> int:
    """`fast_launch_module` on every loaded module whose name starts with `prefix`."""
    return sum(
        fast_launch_module(m)
        for name, m in list(sys.modules.items())
        if name.startswith(prefix) and m is not None
    )
