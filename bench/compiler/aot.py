"""Capture the Triton launches of Python launch code and compile them ahead of time for an NVIDIA GPU.

Nothing here knows the kernels: ``capture_launches(run)`` calls ``run()`` (launch code running on
meta or CPU tensors, with ``TRITON_INTERPRET`` unset) while ``JITFunction.run`` and
``Autotuner.run`` record instead of launching; an autotuned launch is recorded once per config
its autotuner may pick (after ``prune_configs``, as ``Autotuner.run`` would benchmark them).
``compile_launch`` then specialises the recorded arguments the way a real launch does (triton's own
binder: pointer dtypes, 16-byte alignment of pointers and of integers divisible by 16, integers
equal to 1 as constexprs) and compiles for ``GPUTarget("cuda", arch, 32)`` (``target(arch)``, arch =
10 * major + minor: 80, 86, 89, 90, 100, 120, ...) with the launch's options.

Registers and spills come from ptxas's ``-v`` log of the very command triton assembles with
(``make_cubin``: ``--gpu-name=sm_90a``/``sm_100a``/``sm_120a`` from 90 up; the bundled ptxas, or
ptxas-blackwell for sm_100+ on triton 3.6 and sm_90+ on 3.9); shared memory and tensor memory
(Blackwell's TMEM columns) from the compiled kernel's metadata, the numbers triton checks at launch;
the SASS with source lines from ``nvdisasm -c -gi`` on the cubin.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

# A pointer's 16-byte alignment is what the binder specialises on; real allocations (CUDA's caching
# allocator) start at multiples of 512 bytes, so a tensor's address is this base plus its offset.
_ALLOCATION_BASE = 1 << 20


@dataclass
class Launch:
    """One kernel launch as the launch code issued it (for one autotuner config)."""

    fn: JITFunction
    args: tuple
    kwargs: dict  # keyword arguments, the config's included (num_warps, num_stages, ...)
    config: triton.Config | None = None  # the autotuner config this launch is recorded for
    labels: dict = field(default_factory=dict)  # what the caller set in recorder.labels at the launch
    grid: object = None  # as launched: a tuple, or a function of the launch's arguments by name

    @property
    def autotuned(self) -> bool:
        return self.config is not None

    @property
    def name(self) -> str:
        return self.fn.__name__

    def constexprs(self) -> dict:
        """The constexpr parameters passed by name (flags and tile sizes), with their values."""
        names = {p.name for p in self.fn.params if p.is_constexpr}
        return {k: v for k, v in self.kwargs.items() if k in names}


@dataclass
class Recorder:
    """Collects the launches made while ``capture_launches`` is active."""

    launches: list = field(default_factory=list)
    labels: dict = field(default_factory=dict)  # copied onto each launch (e.g. set by a spy in pruning)
    _config: triton.Config | None = None


@contextlib.contextmanager
def capture_launches():
    """Within the block, Triton launches are recorded in ``recorder.launches`` instead of run."""
    recorder = Recorder()
    jit_run, autotuner_run = JITFunction.run, Autotuner.run

    def record_jit(self, *args, grid, warmup, **kwargs):
        recorder.launches.append(Launch(self, tuple(_tables_only(a) for a in args),
                                        {k: _tables_only(v) for k, v in kwargs.items()}, recorder._config,
                                        dict(recorder.labels), grid))
        return None

    def record_autotuned(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        try:
            configs = self.prune_configs(kwargs)
        finally:
            self.nargs = None
        for config in configs:
            recorder._config = config
            try:
                self.fn.run(*args, **kwargs, **config.all_kwargs())
            finally:
                recorder._config = None
        return None

    JITFunction.run, Autotuner.run = record_jit, record_autotuned
    try:
        yield recorder
    finally:
        JITFunction.run, Autotuner.run = jit_run, autotuner_run


@contextlib.contextmanager
def interpreting():
    """Within the block JIT functions run in triton's interpreter (on CPU tensors), in a process that
    imported them to compile (``TRITON_INTERPRET`` unset): a launch, and the JIT functions it calls
    (triton's own included), go to ``InterpretedFunction``, and triton's language is as before
    afterwards (the interpreter's own call of a JIT function leaves it patched). Triton 3.6's interpreter reads an integer argument used as a loop bound as a one-element
    array, which NumPy 2 no longer turns into an int; 3.9 squeezes it first, as here."""
    run, call, patch_tensor = JITFunction.run, JITFunction.__call__, interpreter._patch_lang_tensor

    def patch_tensor_squeezed(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: InterpretedFunction(self.fn).run(
        *args, grid=grid, warmup=warmup, **kwargs)
    def call_interpreted(self, *args, **kwargs):  # as InterpretedFunction.__call__, the language restored after
        scope = interpreter._patch_lang(self.fn)
        try:
            return InterpretedFunction(self.fn).rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    JITFunction.__call__ = call_interpreted
    interpreter._patch_lang_tensor = patch_tensor_squeezed
    try:
        yield
    finally:
        JITFunction.run, JITFunction.__call__, interpreter._patch_lang_tensor = run, call, patch_tensor


def _tables_only(arg):
    """A floating-point tensor as a meta tensor of the same layout (its values never place a memory
    access, and the report holds many launches); integer tensors (row tables) keep their values."""
    import torch

    if isinstance(arg, torch.Tensor) and arg.device.type != "meta" and arg.is_floating_point():
        storage = torch.empty(arg.untyped_storage().nbytes() // arg.element_size(), dtype=arg.dtype, device="meta")
        return storage.as_strided(arg.shape, arg.stride(), arg.storage_offset())
    return arg


def grid_size(launch: Launch) -> tuple:
    """The launch's grid as three ints (the grid function evaluated on its arguments by name)."""
    grid = launch.grid
    if callable(grid):
        grid = grid({**dict(zip(launch.fn.arg_names, launch.args)), **launch.kwargs})
    grid = tuple(grid) + (1,) * (3 - len(grid))
    return tuple(int(g) for g in grid[:3])


def lane_inputs(launch: Launch, arch: int) -> tuple:
    """What ``sass.smem_traffic`` needs of the launch: {PTX parameter index: (value, known)} (a
    pointer is a made-up address in a region of its own) and ``memory(addresses, known, width)``,
    the little-endian integers stored there (known only in tensors that hold values: on the CPU,
    integer)."""
    import numpy as np
    import torch

    signature, constexprs, _attrs, _options = specialise(launch, arch)
    by_name = {**dict(zip(launch.fn.arg_names, launch.args)), **launch.kwargs}
    values, regions = {}, []
    runtime = [name for name, kind in signature.items() if kind != "constexpr"]
    for index, name in enumerate(runtime):
        arg = by_name.get(name)
        if isinstance(arg, torch.Tensor):
            base = (len(regions) + 1) << 36
            data = None
            if arg.device.type == "cpu" and not arg.is_floating_point():
                data = torch.empty(0, dtype=torch.uint8).set_(arg.untyped_storage()).numpy()
            regions.append(data)
            values[index] = (base + arg.storage_offset() * arg.element_size(), True)
        elif isinstance(arg, (bool, int)):
            values[index] = (int(arg), True)
        else:
            values[index] = (0, False)

    def memory(addresses, known, width):
        region = (addresses >> 36) - 1
        offset = addresses - ((region + 1) << 36)
        out, ok = np.zeros(len(addresses), np.int64), np.zeros(len(addresses), bool)
        for r in np.unique(region[known]):
            data = regions[r] if 0 <= r < len(regions) else None
            if data is None:
                continue
            lanes = known & (region == r) & (offset >= 0) & (offset + width <= len(data))
            for byte in range(width):
                out[lanes] |= data[offset[lanes] + byte].astype(np.int64) << (8 * byte)
            ok |= lanes
        return out, ok

    return values, memory


class _PlacedTensor:
    """What triton's binder sees of a tensor: its dtype and an address with the tensor's alignment."""

    def __init__(self, tensor):
        self.dtype = tensor.dtype
        self._address = _ALLOCATION_BASE + tensor.storage_offset() * tensor.element_size()

    def data_ptr(self) -> int:
        return self._address


def _placed(arg):
    if hasattr(arg, "data_ptr") and hasattr(arg, "storage_offset"):
        return _PlacedTensor(arg)
    return arg


@dataclass
class Compiled:
    """What the compiler produced for one launch."""

    kernel: str
    regs: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    smem_bytes: int
    tmem_columns: int | None  # Blackwell tensor memory (None where triton does not report it)
    sass: str  # nvdisasm -c -gi
    ptx: str
    ptxas_log: str


def target(arch: int) -> GPUTarget:
    return GPUTarget("cuda", arch, 32)


def specialise(launch: Launch, arch: int):
    """(signature, constexprs, attrs, options) of the launch as ``JITFunction.run`` computes them
    on a GPU of ``arch``."""
    backend = make_backend(target(arch))
    fn = launch.fn
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # triton >= 3.7
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    args = tuple(_placed(a) for a in launch.args)
    kwargs = {k: _placed(v) for k, v in kwargs.items()}
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


@contextlib.contextmanager
def _ptxas_log_to(out: io.StringIO):
    """Within the block, triton's assembly step (``make_cubin``) prints ptxas's -v log into ``out``."""
    with knobs.nvidia.scope():
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(out):
            yield


def _log_number(pattern: str, log: str) -> int:
    found = re.search(pattern, log)
    return int(found.group(1)) if found else 0


def disassemble(cubin: bytes) -> str:
    """SASS with source lines (``nvdisasm -c -gi``). ``-ndf`` skips nvdisasm's dataflow analysis,
    which prints nothing here: the same text on every cubin tried (180, both tritons' nvdisasm),
    in three quarters of the time."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([knobs.nvidia.nvdisasm.path, "-c", "-gi", "-ndf", path], check=True,
                              capture_output=True, text=True).stdout


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile the launch for ``arch`` and read registers, spills, shared and tensor memory, SASS."""
    signature, constexprs, attrs, options = specialise(launch, arch)
    log = io.StringIO()
    with _ptxas_log_to(log):
        compiled = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target(arch),
                                  options=options.__dict__)
    if "Used" not in log.getvalue():  # taken from triton's cache: assemble the PTX once more for the log
        with _ptxas_log_to(log):
            make_backend(target(arch)).make_cubin(compiled.asm["ptx"], {}, options, arch)
    log = log.getvalue()
    if "Used" not in log:
        raise RuntimeError(f"no ptxas -v report for {launch.name}:\n{log}")
    return Compiled(
        kernel=launch.name,
        regs=_log_number(r"Used (\d+) registers", log),
        spill_store_bytes=_log_number(r"(\d+) bytes spill stores", log),
        spill_load_bytes=_log_number(r"(\d+) bytes spill loads", log),
        stack_bytes=_log_number(r"(\d+) bytes stack frame", log),
        smem_bytes=int(compiled.metadata.shared),
        tmem_columns=getattr(compiled.metadata, "tmem_size", None),
        sass=disassemble(compiled.asm["cubin"]),
        ptx=compiled.asm["ptx"],
        ptxas_log=log,
    )


def compile_key(launch: Launch, arch: int) -> str:
    """Two launches with equal keys compile to the same binary for ``arch``."""
    signature, constexprs, attrs, options = specialise(launch, arch)
    return repr((arch, launch.fn.cache_key, sorted(signature.items()), sorted(constexprs.items(), key=str),
                 sorted(attrs.items(), key=str), sorted(options.__dict__.items(), key=str)))


def toolchain_problem(arch: int) -> str | None:
    """Why code for ``arch`` cannot be produced here (None when it can)."""
    try:
        backend = make_backend(target(arch))
        tools = [knobs.nvidia.nvdisasm.path]
        from triton.backends.nvidia.compiler import get_ptxas

        tools.append(get_ptxas(arch).path)
    except Exception as exc:  # noqa: BLE001 - any failure means no NVIDIA toolchain
        return f"triton {triton.__version__} has no usable NVIDIA backend: {type(exc).__name__}: {exc}"
    missing = [t for t in tools if not (t and os.path.exists(t))]
    if missing:
        return f"missing NVIDIA tools: {missing}"
    del backend
    return None
