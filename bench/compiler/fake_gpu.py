"""A stand-in for triton's CUDA driver: the kernels' real launch path on a machine without a GPU.

Inside ``fake_gpu(arch)`` triton's JIT takes ``sm_<arch>`` as the current device: it binds and
specialises the arguments, compiles with its bundled toolchain (cached like any compile), runs the
autotuner, and launches through a stub that records the call (``FakeGpu.launches``) instead of
reaching a GPU. Only the driver's own work is missing: the C launcher's argument packing and
``cuLaunchKernelEx``. The autotuner "times" the configs it is given in order, so it picks the first
(the candidates' best guess). Tensors may be on the CPU or the meta device: the kernels never run.

Used to measure the host cost of a call (``bench.host_cost``) and to test that the launcher's bound
launches pass triton what its JIT would (``tests/test_launch_cache.py``) and that binaries compiled
ahead are the JIT's (``tests/test_precompile.py``). ``triton_backend_on`` lets the op take its Triton
path on CPU or meta tensors, for this and for ``aot.capture_launches``; ``autocast_on_meta`` gives a
model step on meta tensors the dtypes CUDA's autocast would (the campaign's ``compile`` step). Needs
the kernels imported in compiled mode (``TRITON_INTERPRET`` unset) and a triton with its NVIDIA
backend.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

# What each arch lets one block use (bytes): triton checks it when it loads a kernel.
MAX_SHARED_MEMORY = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}


@dataclass
class Launch:
    """One launch as it reached the driver: the kernel, its binary (triton's hash), grid and the
    launcher's arguments."""

    kernel: str
    binary: str
    grid: tuple
    args: tuple


@dataclass
class FakeGpu:
    """The fake device's record: every launch that reached the driver, in order (with its arguments
    when ``keep_args``; a benchmark keeps none: they would keep every call's tensors alive)."""

    arch: int
    keep_args: bool = True
    launches: list = field(default_factory=list)

    def count(self) -> int:
        return len(self.launches)


class _Launcher:
    """Replaces triton's compiled C launcher of one kernel: records instead of launching."""

    def __init__(self, gpu: FakeGpu, src, metadata):
        self.gpu, self.name, self.binary = gpu, src.fn.__name__, getattr(metadata, "hash", "")

    def __call__(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata, enter_hook,
                 exit_hook, *args):
        self.gpu.launches.append(Launch(self.name, self.binary, (grid_x, grid_y, grid_z),
                                        args if self.gpu.keep_args else ()))


class _Driver:
    """The part of triton's ``CudaDriver`` the JIT, the compiler and the autotuner call."""

    def __init__(self, gpu: FakeGpu):
        self.target = GPUTarget("cuda", gpu.arch, 32)
        properties = {"max_shared_mem": MAX_SHARED_MEMORY.get(gpu.arch, MAX_SHARED_MEMORY[80]),
                      "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}
        # a loaded module and function, as from the driver (not None: triton loads a kernel once and
        # tells a loaded one by its module, so a None here would rebuild the launcher at every launch)
        self.utils = types.SimpleNamespace(
            load_binary=lambda name, kernel, shared, device: (f"module:{name}", f"function:{name}", 0, 0, 1024),
            get_device_properties=lambda device: properties)
        self.launcher_cls = lambda src, metadata: _Launcher(gpu, src, metadata)
        order = itertools.count()
        # each config "timed" takes longer than the one before: the autotuner keeps the first
        self._bench = lambda kernel_call, quantiles=None, **_: (kernel_call(), [float(next(order))] * 3)[1]

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=None):
        return divmod(self.target.arch, 10)

    def get_active_torch_device(self):
        return torch.device("meta")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        return self._bench


@contextlib.contextmanager
def fake_gpu(arch: int = 90, keep_args: bool = True):
    """Within the block triton compiles for and "launches" on a fake ``sm_<arch>`` (see module doc)."""
    gpu = FakeGpu(arch, keep_args)
    saved = driver._active
    driver.set_active(_Driver(gpu))
    try:
        yield gpu
    finally:
        driver._active = saved


@contextlib.contextmanager
def triton_backend_on(device: str):
    """The op's Triton backend for ``device``'s tensors, which it refuses off CUDA (nothing runs: the
    launches reach a fake GPU, ``fake_gpu``, or a recorder, ``aot.capture_launches``), and on meta
    tensors the op's real implementations (its custom ops' Meta kernels are shape functions)."""
    from xlnet_fast.attention import args, backends, op

    resolve, value_checks = backends.resolve_backend, args.host_value_checks
    backends.resolve_backend = lambda backend, device: "eager" if backend == "eager" else "triton"
    args.host_value_checks = lambda device: False  # checks of values as on a GPU: on the device
    lib = None
    if device == "meta":
        lib = torch.library.Library("xlnet_fast", "IMPL")
        for name, impl in op.REAL_IMPLEMENTATIONS.items():
            lib.impl(name, impl, "Meta", allow_override=True)
    try:
        yield
    finally:
        backends.resolve_backend, args.host_value_checks = resolve, value_checks
        if lib is not None:
            lib._destroy()


# What CUDA's torch.autocast does to the functions a model step calls: matrix products in the
# autocast dtype, normalisation, softmax and losses in float32 (torch's autocast op lists)
_AUTOCAST_PRODUCTS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.einsum,
                                torch.nn.functional.linear, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
                                torch.addmm, torch.baddbmm})
_AUTOCAST_FLOAT32 = frozenset({torch.nn.functional.layer_norm, torch.nn.functional.softmax, torch.softmax,
                               torch.Tensor.softmax, torch.nn.functional.log_softmax, torch.log_softmax,
                               torch.Tensor.log_softmax, torch.nn.functional.cross_entropy})


class _MetaAutocast(TorchFunctionMode):
    """Casts the arguments of the functions above as CUDA's autocast casts them (floating tensors but
    float64), while the innermost ``torch.autocast("meta", ...)`` is enabled (none is at first)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.enabled = dtype, [False]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to = None if not self.enabled[-1] else \
            self.dtype if func in _AUTOCAST_PRODUCTS else torch.float32 if func in _AUTOCAST_FLOAT32 else None
        if to is not None:
            def cast(x):
                if isinstance(x, (list, tuple)):
                    return type(x)(cast(y) for y in x)
                return x.to(to) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64 \
                    else x
            args, kwargs = cast(args), {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def nested(self, enabled: bool):
        self.enabled.append(enabled)
        try:
            yield
        finally:
            self.enabled.pop()


@contextlib.contextmanager
def autocast_on_meta(dtype: torch.dtype = torch.bfloat16):
    """Within the block ``torch.autocast("meta", dtype=..., enabled=...)`` (which torch refuses: autocast
    knows no meta device) acts on meta tensors as CUDA's autocast acts on CUDA ones, as far as a model
    step's dtypes go: the functions above cast, ``torch.is_autocast_enabled("meta")`` and the package's
    ``autocast_dtype("meta")`` answer. So a model step on meta tensors passes the op the dtypes it gets
    under autocast on a GPU (``tests/test_precompile.py`` checks this against the CPU's autocast)."""
    from xlnet_fast.attention import args

    mode = _MetaAutocast(dtype)
    autocast, enabled, autocast_dtype_of, no_autocast = (torch.autocast, torch.is_autocast_enabled,
                                                         torch.get_autocast_dtype, args.NO_AUTOCAST_DEVICES)

    def meta_or(real, on_meta):  # torch's function, or on_meta's answer for device type "meta"
        def call(*a, **k):
            if (a[0] if a else k.get("device_type")) != "meta":
                return real(*a, **k)
            return on_meta(*a[1:], **{name: v for name, v in k.items() if name != "device_type"})
        return call

    torch.autocast = meta_or(autocast, lambda dtype=None, enabled=True, cache_enabled=None: mode.nested(enabled))
    torch.is_autocast_enabled = meta_or(enabled, lambda: mode.enabled[-1])
    torch.get_autocast_dtype = meta_or(autocast_dtype_of, lambda: dtype)
    args.NO_AUTOCAST_DEVICES = tuple(d for d in no_autocast if d != "meta")
    try:
        with mode:
            yield
    finally:
        torch.autocast, torch.is_autocast_enabled, torch.get_autocast_dtype = autocast, enabled, autocast_dtype_of
        args.NO_AUTOCAST_DEVICES = no_autocast
