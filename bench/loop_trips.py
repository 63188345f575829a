"""How many times each source loop of a kernel runs for a recorded launch, measured in triton's
CPU interpreter.

A launch recorded by ``bench.aot.capture_launches`` on CPU tensors (so the index data that decides
data-dependent loop bounds is real) is replayed in the interpreter for a sample of its programs:
indices of grid axis 0 spread over the axis (ends, midpoints, ...) until an iteration budget is
spent, and ``samples`` evenly spaced indices of each further axis. A line tracer counts, per ``for``/``while``
statement of the kernel's source files, how often control passes from the loop's line into its
body: the iterations. Nothing is kernel-specific; the values the interpreter computes are
irrelevant (bf16 dots run in numpy), only control flow is read. Launch options (warps, stages) do not
exist for the interpreter: configs differing only there give the same counts.

To save time, innermost loops over ``range``/``tl.range`` (no loop in their body, nor in the jit
functions of the module it calls) are not run: their iterations are the length of their range at
each entry. This assumes no loop bound depends on a value computed inside an innermost loop.
"""

from __future__ import annotations

import ast
import builtins
import functools
import itertools
import os
import sys
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


_realpath = functools.lru_cache(maxsize=None)(os.path.realpath)  # the tracer sees every call


@dataclass(frozen=True)
class SourceLoop:
    """A ``for``/``while`` statement: its file (real path), its line and its body's lines."""

    file: str
    line: int
    end: int  # last line of the body
    body: int  # first line of the body

    def contains(self, file: str, line: int) -> bool:
        return _realpath(file) == self.file and self.line <= line <= self.end

    @property
    def where(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"


@functools.lru_cache(maxsize=None)
def loops_in(path: str) -> tuple:
    """Every loop statement of a Python source file."""
    path = os.path.realpath(path)
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    return tuple(SourceLoop(path, node.lineno, node.end_lineno, node.body[0].lineno)
                 for node in ast.walk(tree) if isinstance(node, (ast.For, ast.While)))


def _calls(node) -> set:
    return {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


@functools.lru_cache(maxsize=None)
def innermost_range_loops(path: str) -> dict:
    """{line of the loop header: SourceLoop} for the loops over ``range(...)``/``tl.range(...)`` of
    a file that contain no loop, directly or through a call to a function defined in the file."""
    path = os.path.realpath(path)
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}

    def has_loop(node, seen=frozenset()) -> bool:
        if any(isinstance(n, (ast.For, ast.While)) for n in ast.walk(node) if n is not node):
            return True
        return any(has_loop(functions[name], seen | {name}) for name in _calls(node)
                   if name in functions and name not in seen)

    headers = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.For) and isinstance(node.iter, ast.Call)):
            continue
        func = node.iter.func
        over_range = (isinstance(func, ast.Name) and func.id == "range") or (
            isinstance(func, ast.Attribute) and func.attr == "range")
        if over_range and not any(has_loop(stmt) for stmt in node.body):
            loop = SourceLoop(path, node.lineno, node.end_lineno, node.body[0].lineno)
            for line in range(node.lineno, node.iter.end_lineno + 1):
                headers[line] = loop
    return headers


def kernel_files(fn: JITFunction) -> set:
    """Source files (real paths) of the kernel and of the jit functions its module holds."""
    files = {fn.fn.__code__.co_filename}
    for value in fn.fn.__globals__.values():
        if isinstance(value, JITFunction):
            files.add(value.fn.__code__.co_filename)
    return {os.path.realpath(f) for f in files}


def innermost_loop(loops, file: str, line: int) -> SourceLoop | None:
    inside = [loop for loop in loops if loop.contains(file, line)]
    return max(inside, key=lambda loop: loop.line) if inside else None


class _IterationCounter:
    """sys.settrace hook counting loop-line -> body-line transitions in the given files."""

    def __init__(self, files: set):
        self.transitions = {path: {(loop.line, loop.body): loop for loop in loops_in(path)} for path in files}
        self.iterations = Counter()
        self.reached = set()
        self._last_line = {}

    def __call__(self, frame, event, arg):
        transitions = self.transitions.get(_realpath(frame.f_code.co_filename))
        if transitions is None:
            return None
        heads = {line: loop for (line, _), loop in transitions.items()}

        def local(frame, event, arg):
            if event == "line":
                line = frame.f_lineno
                if line in heads:
                    self.reached.add(heads[line])
                loop = transitions.get((self._last_line.get(id(frame)), line))
                if loop is not None:
                    self.iterations[loop] += 1
                self._last_line[id(frame)] = line
            elif event == "return":
                self._last_line.pop(id(frame), None)
            return local

        return local


class _GlobalsView:
    """A module's globals dict as an object whose attributes are its keys (for patch scopes)."""

    def __init__(self, namespace: dict):
        object.__setattr__(self, "_namespace", namespace)

    def __getattr__(self, name):
        try:
            return self._namespace[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self._namespace[name] = value

    def __delattr__(self, name):
        del self._namespace[name]


class _Interpreting:
    """Run compiled-mode jit functions in triton's interpreter: the kernel and every jit function it
    calls (its helpers, triton.language's own) execute as their interpreter rewrites, with
    triton.language patched as ``InterpretedFunction`` does; all patches are undone on exit."""

    def __init__(self, files: set):
        self._rewrites, self._scopes = {}, []
        self._call = JITFunction.__call__
        self._innermost = {path: innermost_range_loops(path) for path in files}
        self.skipped = Counter()  # innermost loop -> iterations not run

    def _range(self, caller, *args):
        """``range(*args)``, or an empty one (its length counted) for an innermost loop."""
        loop = self._innermost.get(_realpath(caller.f_code.co_filename), {}).get(caller.f_lineno)
        if loop is None:
            return builtins.range(*args)
        self.skipped[loop] += len(builtins.range(*args))
        return builtins.range(0)

    def rewrite(self, fn: JITFunction):
        key = id(fn)  # not hash(fn): that walks the source, and fails with triton.language patched
        if key not in self._rewrites:
            scope = interpreter._patch_lang(fn.fn)
            # triton 3.6 converts 1-element arrays with int(), which numpy >= 2.3 refuses
            scope.set_attr(tl.core.tensor, "__index__", lambda t: int(t.handle.data.reshape(-1)[0]))
            if fn.fn.__globals__.get("range", builtins.range) is builtins.range:
                scope.set_attr(_GlobalsView(fn.fn.__globals__), "range",
                               lambda *args: self._range(sys._getframe(1), *args))
            scope.set_attr(tl, "range", lambda start, end=None, step=None, **_: self._range(
                sys._getframe(1), *((0, start) if end is None else (start, end)), 1 if step is None else step))
            self._scopes.append(scope)
            self._rewrites[key] = InterpretedFunction(fn.fn).rewrite()
        return self._rewrites[key]

    def __enter__(self):
        rewrite = self.rewrite

        def call(fn, *args, **kwargs):
            return rewrite(fn)(*args, **kwargs)

        JITFunction.__call__ = call
        return self

    def __exit__(self, *exc):
        JITFunction.__call__ = self._call
        for scope in reversed(self._scopes):
            scope.restore()


def _spaced(extent: int, n: int) -> list:
    """``n`` evenly spaced indices of ``range(extent)``, first and last included."""
    n = min(n, extent)
    return sorted({round(i * (extent - 1) / max(n - 1, 1)) for i in range(n)})


def progressive(extent: int) -> list:
    """All of ``range(extent)``, ordered so that every prefix is spread over the range: the ends,
    then the midpoints of the gaps, level by level."""
    if extent <= 2:
        return list(range(extent))
    order, gaps = [0, extent - 1], [(0, extent - 1)]
    while gaps:
        wider = []
        for lo, hi in gaps:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                order.append(mid)
                wider += [(lo, mid), (mid, hi)]
        gaps = wider
    return order


@dataclass
class Replay:
    """Iterations per source loop over the programs replayed."""

    iterations: dict  # SourceLoop -> iterations (0: reached, never entered)
    programs: int  # programs run
    of: int  # programs in the grid


def count_iterations(launch, budget: int = 2000, samples: int = 1) -> Replay:
    """Replay the sampled programs of ``launch`` (a ``bench.aot.Launch`` recorded on CPU tensors):
    indices of grid axis 0 in ``progressive`` order until the loops that ran (innermost ones aside)
    have made ``budget`` iterations (0: all programs; at least 2), ``samples`` evenly spaced indices
    of each further axis."""
    grid = launch.grid_for()
    if grid is None:
        raise ValueError(f"cannot evaluate the grid of {launch.name}")
    grid = grid + (1,) * (3 - len(grid))
    others = list(itertools.product(*[_spaced(extent, samples) for extent in grid[1:]]))
    counter = _IterationCounter(kernel_files(launch.fn))
    builder = interpreter.interpreter_builder
    names = [p.name for p in launch.fn.params]
    constexprs = {p.name for p in launch.fn.params if p.is_constexpr}
    bound = dict(zip(names, launch.args))
    bound.update({k: v for k, v in launch.kwargs.items() if k in names})
    programs = 0
    with _Interpreting(kernel_files(launch.fn)) as interpreting:
        kernel = interpreting.rewrite(launch.fn)
        bound = {k: v if k in constexprs else interpreter._implicit_cvt(v) for k, v in bound.items()}
        builder.set_grid_dim(*grid)
        previous = sys.gettrace()
        sys.settrace(counter)
        try:
            # skipped loop bodies leave garbage values (overflows, NaN): only control flow matters
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for x in progressive(grid[0]):
                    for rest in others:
                        builder.set_grid_idx(x, *rest)
                        kernel(**bound)
                    programs += 1
                    if budget and programs >= 2 and sum(counter.iterations.values()) >= budget:
                        break
        finally:
            sys.settrace(previous)
    counts = Counter({loop: 0 for loop in counter.reached})
    counts.update(counter.iterations)
    counts.update(interpreting.skipped)
    return Replay(dict(counts), programs * len(others), grid[0] * len(others))
