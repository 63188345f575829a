"""Kernel launches bound once per call shape.

At every launch triton's JIT binds the arguments by name, specialises them, looks the binary up and
packs the launch; with the autotuner in front it also builds its key. For the attention kernels'
~46 arguments that is ~70 µs per launch, ~115 µs autotuned (bench/NOTES.md: measured with
``bench.compiler.fake_gpu`` on this project's CPU), several times what the rest of a call costs.
Here that work happens at the first launch of a kernel for each call shape; later launches of the
same shape hand their tensors straight to the compiled kernel (``CompiledKernel[grid]``, triton's
own launcher of a compiled kernel), with the other arguments as the first launch bound them.

The caller's ``shape`` key must determine every non-tensor argument of the launch and the dtype and
16-byte alignment of every tensor argument: what triton specialises a binary on
(``tests/test_launch_cache.py`` checks the bound launches against triton's JIT on a fake GPU).
"""

from __future__ import annotations

from typing import Callable

# (role, shape, deterministic) -> _Bound
_BOUND: dict = {}


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
        for i, name in self.slots:
            args[i] = tensors[name]
        self.runner(*args)


def bound(role: str, shape, deterministic: bool):
    """The bound launch of ``role`` at ``shape``, or None before its first launch."""
    return _BOUND.get((role, shape, deterministic))


def bind(role: str, shape, deterministic: bool, fn, compiled, grid: Callable | tuple, kwargs: dict,
         tensors: dict, tiles) -> None:
    """Keep ``compiled`` (what the JIT launched for ``kwargs``, a config's values included) for the
    later launches of ``role`` at ``shape``: only the values named in ``tensors`` change between them.
    ``tiles``: the config the launch ran at, handed back by later launches."""
    if compiled is None or not hasattr(compiled, "__getitem__"):
        return  # not a compiled kernel (an older triton): every launch goes through the JIT
    grid = grid(kwargs) if callable(grid) else grid
    grid = tuple(grid) + (1,) * (3 - len(grid))
    _BOUND[(role, shape, deterministic)] = _Bound(fn, compiled, grid, kwargs, tuple(tensors), tiles)


def clear() -> None:
    """Forget every bound launch (the next launch of each shape goes through the JIT again)."""
    _BOUND.clear()
