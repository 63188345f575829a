"""Kernel launches bound once per call shape.

At every launch triton's JIT binds the arguments by name, specialises them, looks the binary up and
packs the launch; with the autotuner in front it also builds its key. For the attention kernels'
~46 arguments that is ~70 µs per launch, ~115 µs autotuned (bench/NOTES.md: measured with
``bench.compiler.fake_gpu`` on this project's CPU), several times what the rest of a call costs.
Here that work happens at the first launch of a kernel for each call shape; later launches of the
same shape hand their tensors straight to the compiled kernel (``CompiledKernel[grid]``, triton's
own launcher of a compiled kernel), with the other arguments as the first launch bound them.

The caller keeps a kernel's bound launch per call shape (``kernels/__init__.py``: in the shape's plan)
and its shape key must determine every non-tensor argument of the launch and the dtype and 16-byte
alignment of every tensor argument: what triton specialises a binary on (``tests/test_launch_cache.py``
checks the bound launches against triton's JIT on a fake GPU).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

# Whether bound launches pass each tensor argument's address (an int) instead of the tensor: triton
# 3.6's launcher then calls no data_ptr() and asks the driver nothing (cuPointerGetAttribute) per
# argument, ~20 per attention launch. Off until a GPU has timed it against tensors (``addresses``;
# bench/NOTES.md, "2026-11-29 (8)").
ADDRESSES = False


@contextlib.contextmanager
def addresses(enabled: bool = True):
    """Inside (a call and its backward), bound launches pass tensor arguments as their addresses."""
    global ADDRESSES
    saved, ADDRESSES = ADDRESSES, enabled
    try:
        yield
    finally:
        ADDRESSES = saved


class _Bound:
    """One kernel's launch at one call shape: the compiled kernel's runner for its grid, its
    arguments in the kernel's order, and where the per-call tensors go in them."""

    __slots__ = ("runner", "template", "slots", "tiles")

    def __init__(self, fn, compiled, grid: tuple, kwargs: dict, tensor_names, tiles):
        self.runner = compiled[grid]
        self.tiles = tiles  # what the first launch returned to its caller (its config)
        values = []
        for param in fn.params:
            # a parameter left to its default (e.g. FIX_UP) is passed its default, as the JIT does
            values.append(kwargs[param.name] if param.name in kwargs else param.default)
        self.template = values
        index = {param.name: i for i, param in enumerate(fn.params)}
        self.slots = tuple((index[name], name) for name in tensor_names)

    def __call__(self, tensors: dict) -> None:
        args = self.template.copy()
        if ADDRESSES:
            for i, name in self.slots:
                value = tensors[name]
                args[i] = value.data_ptr() if isinstance(value, torch.Tensor) else value
        else:
            for i, name in self.slots:
                args[i] = tensors[name]
        self.runner(*args)


def bind(fn, compiled, grid: Callable | tuple, kwargs: dict, tensors: dict, tiles) -> _Bound | None:
    """``compiled`` (what the JIT launched for ``kwargs``, a config's values included) bound for the
    later launches of the same call shape, where only the values named in ``tensors`` change;
    ``tiles``: the config the launch ran at, handed back by later launches. None where ``compiled``
    is not a compiled kernel (an older triton): every launch then goes through the JIT."""
    if compiled is None or not hasattr(compiled, "__getitem__"):
        return None
    grid = grid(kwargs) if callable(grid) else grid
    grid = tuple(grid) + (1,) * (3 - len(grid))
    return _Bound(fn, compiled, grid, kwargs, tuple(tensors), tiles)
