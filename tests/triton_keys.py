"""The Triton variants that host code's kernel launches ask for, found on CPU without a GPU.

Triton compiles a kernel once per specialization: the values of its constexpr parameters and,
for the others, what `triton.runtime.jit` derives from each argument (a tensor's dtype and
whether its address is 16-byte aligned; an integer's width, whether it is 1 and whether it is
a multiple of 16, unless the parameter is in `do_not_specialize`), with the launch options
(`num_warps`, `num_stages`, `launch_pdl`). `recorded_launches` records that key for every
launch made inside it and runs nothing, so a launcher can be called with tensors on the
`meta` device (their addresses are their offsets from an aligned base, as a CUDA allocation's
are) at a real model's sizes. Tests count the compiles a range of step sizes would cost.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple


class Launch(NamedTuple):
    kernel: str
    key: tuple[Any, ...]  # what Triton compiles a variant per


def specialization(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The key Triton's JITFunction.run compiles `kernel` (a JITFunction) per for this call."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in kernel.arg_names})
    bound.apply_defaults()
    parts: list[Any] = []
    for p in kernel.params:
        v = bound.arguments[p.name]
        if p.is_constexpr:
            parts.append((p.name, "constexpr", repr(v)))
        else:
            spec = native_specialize_impl(
                BaseBackend, v, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment
            )
            parts.append((p.name, *spec))
    options = sorted((k, v) for k, v in kwargs.items() if k not in kernel.arg_names)
    return (*parts, *options)


@contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Inside, a Triton launch appends its `Launch` to the list yielded and runs nothing (the
    cached launch path of `fast_launch` is bypassed, as `plain_launches` does)."""
    from triton.runtime.jit import JITFunction

    from deltaserve.kernels.common.fast_launch import plain_launches

    launches: list[Launch] = []

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(self.fn.__qualname__, specialization(self, args, kwargs)))

    run = JITFunction.run
    JITFunction.run = record  # type: ignore[method-assign]
    try:
        with plain_launches():
            yield launches
    finally:
        JITFunction.run = run  # type: ignore[method-assign]


def variants(launches: list[Launch]) -> dict[str, set[tuple[Any, ...]]]:
    """Each kernel's distinct keys: the compiles these launches cost from a cold cache."""
    out: dict[str, set[tuple[Any, ...]]] = {}
    for launch in launches:
        out.setdefault(launch.kernel, set()).add(launch.key)
    return out
