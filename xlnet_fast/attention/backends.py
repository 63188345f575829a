"""Which backend runs a call: ``"eager"`` (PyTorch, ``eager.py``) or ``"triton"`` (``xlnet_fast.kernels``).

``"auto"`` takes the Triton kernels for CUDA tensors they support and the eager path otherwise; a
forced backend never falls back: it runs or raises.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..kernel_contract import contract
from . import eager
from .args import autocast_dtype

BACKENDS = ("auto", "eager", "triton")


def triton_status() -> tuple[bool, str]:
    """(usable, reason): whether the Triton backend can run here at all."""
    try:
        from .. import kernels
    except Exception as exc:  # pragma: no cover - depends on the install
        return False, f"xlnet_fast.kernels failed to import: {exc}"
    return kernels.available()


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``"auto"`` to a concrete backend for tensors on ``device``; check forced backends."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "eager":
        return "eager"
    # the device is checked before the kernels are imported: Triton fixes at import whether its
    # kernels are interpreted, so an import without TRITON_INTERPRET=1 on a CPU machine would leave
    # them unusable for a later interpreted call in the same process
    if backend == "auto" and device.type != "cuda":
        return "eager"
    if device.type != "cuda" and not contract.interpreting():
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (got {device.type}); on CPU set TRITON_INTERPRET=1"
        )
    ok, reason = triton_status()
    if backend == "triton" and not ok:
        raise RuntimeError(f"backend='triton' was forced but cannot run: {reason}")
    return "triton" if ok else "eager"


def backend_for_call(backend: str, q, k, v, k_r) -> str:
    """The concrete backend for one call: ``resolve_backend``, then shapes and dtypes the kernels do
    not handle run eagerly under ``"auto"`` and raise when ``"triton"`` was forced."""
    resolved = resolve_backend(backend, q.device)
    if resolved != "triton":
        return resolved
    from .. import kernels

    try:
        kernels.check_supported(q, k, v, k_r)
    except ValueError:
        if backend == "triton":  # forced: never fall back
            raise
        return "eager"
    return "triton"


def explain_auto_backend(device: torch.device) -> str:
    """One line saying which backend ``auto`` picks on ``device`` and why (for ``xlnet-fast info``)."""
    ok, reason = triton_status()
    if device.type != "cuda":
        return f"eager ({device.type} tensors; the Triton backend runs on CUDA)"
    if not ok:
        return f"eager (Triton unusable: {reason})"
    from .. import kernels

    fp32 = {"tf32": "TF32 dots (torch allows TF32)",
            "tf32x3": "3xTF32 dots, about fp32 accuracy (torch's float32_matmul_precision is 'highest')"}
    return f"triton (fp32 inputs: {fp32[kernels.fp32_precision()]})"


def _implementation(backend: str):
    if backend == "triton":
        from .. import kernels

        return kernels
    return eager


def run_backend(backend: str, name: str, *args):
    """``forward``/``backward`` of a concrete backend, with torch.autocast off (the arguments come in
    the dtype they compute in; the backends choose their own accumulation precision); an
    out-of-memory error of the eager path says what to use instead."""
    implementation = getattr(_implementation(backend), name)
    try:
        device_type = args[0].device.type
        if autocast_dtype(device_type) is None:  # entering a disabled autocast costs host time
            return implementation(*args)
        with torch.autocast(device_type, enabled=False):
            return implementation(*args)
    except torch.OutOfMemoryError as exc:
        if backend != "eager":
            raise
        raise torch.OutOfMemoryError(
            f"{exc}\nxlnet_fast: the eager backend materialises (B, H, M, K) attention scores; on CUDA "
            "use backend='triton' (the fused kernels keep O(L) memory) or shorter sequences") from exc
    except RuntimeError as exc:
        if backend != "eager" or "alloc" not in str(exc).lower():
            raise
        raise RuntimeError(
            f"{exc}\nxlnet_fast: out of memory in the eager backend, which materialises (B, H, M, K) "
            "attention scores; on a GPU, backend='triton' keeps O(L) memory") from exc


_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def through_dispatcher(tensors) -> bool:
    """Whether the package calls its ops (``op._RelAttention``, ``prepared.triton_tables``) through
    torch's dispatcher: while torch.compile traces (it sees the op, opaque, and its fake), under a
    dispatch mode or with a tensor subclass among the inputs ``tensors`` (whatever they expect of an
    op). Else it calls their implementations directly: the dispatcher's wrapper of a Python custom op
    costs ~25 µs per call (bench/NOTES.md)."""
    return (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or any(type(t) not in _PLAIN_TENSORS for t in tensors if t is not None))
