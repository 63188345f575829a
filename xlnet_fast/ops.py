"""The public op ``rel_attention``: validation, backend dispatch and the ``torch.library`` op.

One op serves both XLNet streams. ``rel_attention`` validates and normalises its arguments, then calls
``torch.ops.xlnet_fast.rel_attention`` (forward, returns ``out`` and the row log-sum-exp), whose
autograd formula calls ``torch.ops.xlnet_fast.rel_attention_backward``. Both dispatch on ``backend``
to the eager implementation (``xlnet_fast.eager``) or the Triton kernels (``xlnet_fast.kernels``).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from . import eager
from .eager import AttnArgs

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
BACKENDS = ("auto", "eager", "triton")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------------------


def triton_status() -> tuple[bool, str]:
    """(usable, reason): whether the Triton backend can run here at all."""
    try:
        from . import kernels
    except Exception as exc:  # pragma: no cover - depends on the install
        return False, f"xlnet_fast.kernels failed to import: {exc}"
    return kernels.available()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``"auto"`` to a concrete backend for tensors on ``device``; check forced backends."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "eager":
        return "eager"
    ok, reason = triton_status()
    if backend == "triton":
        if not ok:
            raise RuntimeError(f"backend='triton' was forced but cannot run: {reason}")
        if device.type != "cuda" and not _interpreting():
            raise RuntimeError(
                f"backend='triton' needs CUDA tensors (got {device.type}); on CPU set TRITON_INTERPRET=1"
            )
        return "triton"
    return "triton" if ok and device.type == "cuda" else "eager"


def explain_auto_backend(device: torch.device) -> str:
    """One line saying which backend ``auto`` picks on ``device`` and why (for ``xlnet-fast info``)."""
    ok, reason = triton_status()
    if device.type != "cuda":
        return f"eager ({device.type} tensors; the Triton backend runs on CUDA)"
    return "triton" if ok else f"eager (Triton unusable: {reason})"


# --------------------------------------------------------------------------------------------------
# The torch.library ops
# --------------------------------------------------------------------------------------------------


def _args(r_s_bias, seg_embed, q_seg, k_seg, attn_mask, q_rank, k_rank, q_pos, qlen, self_rows,
          scale, dropout_p, seed, rows_cover_qlen) -> AttnArgs:
    return AttnArgs(r_s_bias, seg_embed, q_seg, k_seg, attn_mask, q_rank, k_rank, q_pos, qlen,
                    self_rows, scale, dropout_p, seed, rows_cover_qlen)


def _impl(backend: str):
    if backend == "triton":
        from . import kernels

        return kernels
    return eager


def _run(backend: str, name: str, *args):
    """Call the backend; an out-of-memory error of the eager path says what to use instead."""
    try:
        return getattr(_impl(backend), name)(*args)
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


@torch.library.custom_op("xlnet_fast::rel_attention", mutates_args=())
def _rel_attention_op(
    q: Tensor, k: Tensor, v: Tensor, k_r: Tensor, r_w_bias: Tensor, r_r_bias: Tensor,
    r_s_bias: Optional[Tensor], seg_embed: Optional[Tensor], q_seg: Optional[Tensor],
    k_seg: Optional[Tensor], attn_mask: Optional[Tensor], q_rank: Optional[Tensor],
    k_rank: Optional[Tensor], q_pos: Optional[Tensor], qlen: int, self_rows: int,
    rows_cover_qlen: bool, scale: float, dropout_p: float, seed: Optional[Tensor], backend: str,
) -> tuple[Tensor, Tensor]:
    a = _args(r_s_bias, seg_embed, q_seg, k_seg, attn_mask, q_rank, k_rank, q_pos, qlen,
              self_rows, scale, dropout_p, seed, rows_cover_qlen)
    return _run(backend, "forward", q, k, v, k_r, r_w_bias, r_r_bias, a)


@_rel_attention_op.register_fake
def _(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, q_seg, k_seg, attn_mask, q_rank,
      k_rank, q_pos, qlen, self_rows, rows_cover_qlen, scale, dropout_p, seed, backend):
    B, M, H, D = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((B, M, H, D)), q.new_empty((B, H, M), dtype=lse_dtype)


@torch.library.custom_op("xlnet_fast::rel_attention_backward", mutates_args=())
def _rel_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, k_r: Tensor, r_w_bias: Tensor, r_r_bias: Tensor,
    r_s_bias: Optional[Tensor], seg_embed: Optional[Tensor], q_seg: Optional[Tensor],
    k_seg: Optional[Tensor], attn_mask: Optional[Tensor], q_rank: Optional[Tensor],
    k_rank: Optional[Tensor], q_pos: Optional[Tensor], qlen: int, self_rows: int,
    rows_cover_qlen: bool, scale: float, dropout_p: float, seed: Optional[Tensor], backend: str,
    out: Tensor, lse: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    a = _args(r_s_bias, seg_embed, q_seg, k_seg, attn_mask, q_rank, k_rank, q_pos, qlen,
              self_rows, scale, dropout_p, seed, rows_cover_qlen)
    grads = _run(backend, "backward", dout, q, k, v, k_r, r_w_bias, r_r_bias, a, out, lse)
    return tuple(g.contiguous() for g in grads)


@_rel_attention_backward_op.register_fake
def _(dout, q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, q_seg, k_seg, attn_mask, q_rank,
      k_rank, q_pos, qlen, self_rows, rows_cover_qlen, scale, dropout_p, seed, backend, out, lse):
    seg_like = seg_embed if seg_embed is not None else r_w_bias.new_empty((2,) + tuple(r_w_bias.shape))
    bias_like = r_s_bias if r_s_bias is not None else r_w_bias
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (q, k, v, k_r, r_w_bias, r_r_bias, bias_like, seg_like))


_TENSOR_ARGS = ("q", "k", "v", "k_r", "r_w_bias", "r_r_bias", "r_s_bias", "seg_embed", "q_seg",
                "k_seg", "attn_mask", "q_rank", "k_rank", "q_pos")
_CONST_ARGS = ("qlen", "self_rows", "rows_cover_qlen", "scale", "dropout_p", "seed", "backend")


def _setup_context(ctx, inputs, output):
    named = dict(zip(_TENSOR_ARGS + _CONST_ARGS, inputs))
    out, lse = output
    ctx.consts = {n: named[n] for n in _CONST_ARGS if n != "seed"}
    ctx.has_seg = named["seg_embed"] is not None
    ctx.save_for_backward(*(named[n] for n in _TENSOR_ARGS), named["seed"], out, lse)


def _backward(ctx, dout, _dlse):
    *tensors, seed, out, lse = ctx.saved_tensors
    c = ctx.consts
    grads = torch.ops.xlnet_fast.rel_attention_backward(
        dout, *tensors, c["qlen"], c["self_rows"], c["rows_cover_qlen"], c["scale"], c["dropout_p"],
        seed, c["backend"], out, lse)
    dq, dk, dv, dk_r, dr_w, dr_r, dr_s, dseg = grads
    if not ctx.has_seg:
        dr_s = dseg = None
    return (dq, dk, dv, dk_r, dr_w, dr_r, dr_s, dseg) + (None,) * 13


_rel_attention_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# Validation and the public entry point
# --------------------------------------------------------------------------------------------------


def _check_tensor(name: str, t, ndim: int, shape: tuple | None = None, dtypes=None, device=None):
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        for got, want in zip(t.shape, shape):
            if want is not None and got != want:
                raise ValueError(f"{name} must have shape {_fmt(shape)}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _fmt(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def _int_tensor(name, t, shape, device, dtypes=(torch.int32, torch.int64)):
    _check_tensor(name, t, len(shape), shape, dtypes, device)
    return t


def _check_positions(q_pos: Tensor, qlen: int) -> None:
    """q_pos values must be < qlen (negative = padding row). A data-dependent check: eagerly a
    ValueError; under torch.compile (no host sync there) an assertion on the device."""
    if not q_pos.numel():
        return
    if torch.compiler.is_compiling():
        torch._assert_async(q_pos.max() < qlen, "xlnet_fast: q_pos values must be < qlen")
    elif int(q_pos.max()) >= qlen:
        raise ValueError(f"q_pos values must be < qlen = {qlen}, got max {int(q_pos.max())}")


def _resolve_scale(scale, D: int) -> float:
    """The softmax scale: ``1/sqrt(D)`` when None; else a finite number."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def _validate(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, q_seg, k_seg, attn_mask,
              q_rank, k_rank, q_pos, qlen, scale, dropout_p) -> tuple[int, float]:
    """Check every argument of ``rel_attention`` (before any launch); returns (qlen, scale)."""
    _check_tensor("q", q, 4)
    device = q.device
    B, M, H, D = q.shape
    if D < 1:
        raise ValueError(f"q must have a head dim D >= 1, got shape {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"q must be float32, bfloat16 or float16 (float64 for eager), got {q.dtype}")
    dtypes = (q.dtype,)
    _check_tensor("k", k, 4, (B, None, H, D), dtypes, device)
    K = k.shape[1]
    _check_tensor("v", v, 4, (B, K, H, D), dtypes, device)
    _check_tensor("k_r", k_r, 4, (None, None, H, D), dtypes, device)
    if k_r.shape[0] not in (1, B):
        raise ValueError(f"k_r must have batch dim 1 or B={B}, got {k_r.shape[0]}")
    R = k_r.shape[1]
    _check_tensor("r_w_bias", r_w_bias, 2, (H, D), dtypes, device)
    _check_tensor("r_r_bias", r_r_bias, 2, (H, D), dtypes, device)
    for name, t in (("q", q), ("k", k), ("v", v), ("k_r", k_r)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")

    seg_parts = {"r_s_bias": r_s_bias, "seg_embed": seg_embed, "q_seg": q_seg, "k_seg": k_seg}
    given = [n for n, t in seg_parts.items() if t is not None]
    if given and len(given) != 4:
        missing = [n for n in seg_parts if n not in given]
        raise ValueError(f"the segment term needs r_s_bias, seg_embed, q_seg and k_seg; missing {missing}")
    if given:
        _check_tensor("r_s_bias", r_s_bias, 2, (H, D), dtypes, device)
        _check_tensor("seg_embed", seg_embed, 3, (2, H, D), dtypes, device)
        _int_tensor("q_seg", q_seg, (B, M), device)
        _int_tensor("k_seg", k_seg, (B, K), device)

    if qlen is None:
        qlen = M
    if not isinstance(qlen, int) or isinstance(qlen, bool):
        raise TypeError(f"qlen must be an int, got {type(qlen).__name__}")
    if not 1 <= qlen <= K:
        raise ValueError(f"qlen must be in [1, K={K}], got {qlen}")
    if R < K + 1:
        raise ValueError(f"k_r needs at least K + 1 = {K + 1} rows, got R = {R}")
    if q_pos is None:
        if M > qlen:
            raise ValueError(f"without q_pos, M = {M} query rows need qlen >= M, got qlen = {qlen}")
    else:
        _int_tensor("q_pos", q_pos, (B, M), device)
        _check_positions(q_pos, qlen)

    if attn_mask is not None and (q_rank is not None or k_rank is not None):
        raise ValueError("pass either attn_mask or q_rank/k_rank, not both")
    if attn_mask is not None:
        _check_tensor("attn_mask", attn_mask, 3, (B, M, K), (torch.bool,), device)
    if (q_rank is None) != (k_rank is None):
        raise ValueError("q_rank and k_rank must be given together")
    if q_rank is not None:
        _int_tensor("q_rank", q_rank, (B, M), device, (torch.int32,))
        _int_tensor("k_rank", k_rank, (B, K), device, (torch.int32,))
    scale = _resolve_scale(scale, D)
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return qlen, float(scale)


def _call(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, q_seg, k_seg, attn_mask, q_rank,
          k_rank, q_pos, qlen, self_rows, scale, dropout_p, backend, rows_cover_qlen=False) -> Tensor:
    resolved = resolve_backend(backend, q.device)
    if resolved == "triton":
        from . import kernels

        try:
            kernels.check_supported(q, k, v, k_r)
        except ValueError:
            if backend == "triton":  # forced: never fall back
                raise
            resolved = "eager"  # "auto": shapes/dtypes the kernels do not handle run eagerly
    seed = torch.randint(0, 2**62, (), dtype=torch.int64) if dropout_p > 0 else None
    out, _ = torch.ops.xlnet_fast.rel_attention(
        q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, q_seg, k_seg, attn_mask, q_rank,
        k_rank, q_pos, int(qlen), int(self_rows), bool(rows_cover_qlen), float(scale), float(dropout_p),
        seed, resolved)
    return out


def rel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_r: Tensor,
    r_w_bias: Tensor,
    r_r_bias: Tensor,
    *,
    r_s_bias: Tensor | None = None,
    seg_embed: Tensor | None = None,
    q_seg: Tensor | None = None,
    k_seg: Tensor | None = None,
    attn_mask: Tensor | None = None,
    q_rank: Tensor | None = None,
    k_rank: Tensor | None = None,
    self_visible: bool = True,
    q_pos: Tensor | None = None,
    qlen: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """XLNet relative attention (docs/DESIGN.md §2, §4). Returns ``(B, M, H, D)`` in q's dtype.

    Shapes: ``q (B, M, H, D)``; ``k, v (B, K, H, D)`` with ``K = mlen + qlen`` (memory first);
    ``k_r (Br, R, H, D)``, ``Br in {1, B}``, ``R >= K + 1``; biases ``(H, D)``; ``seg_embed (2, H, D)``;
    ``q_seg (B, M)``, ``k_seg (B, K)`` segment ids; ``attn_mask (B, M, K)`` bool, True = blocked;
    ``q_rank (B, M)``, ``k_rank (B, K)`` int32: key j visible to query i iff ``k_rank[j] < q_rank[i]``
    or (``self_visible`` and ``j == mlen + p_i``); ``q_pos (B, M)`` int positions of the query rows in
    the current segment (negative = padding row, output 0), default ``arange(M)`` with ``qlen = M``.
    """
    qlen, scale = _validate(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, q_seg, k_seg,
                            attn_mask, q_rank, k_rank, q_pos, qlen, scale, dropout_p)
    if not isinstance(self_visible, bool):
        raise TypeError(f"self_visible must be a bool, got {type(self_visible).__name__}")
    return _call(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, q_seg, k_seg, attn_mask,
                 q_rank, k_rank, q_pos, qlen, q.shape[1] if self_visible else 0, scale, dropout_p,
                 backend)


def rel_attention_two_stream(
    q_h: Tensor,
    q_g: Tensor,
    k: Tensor,
    v: Tensor,
    k_r: Tensor,
    r_w_bias: Tensor,
    r_r_bias: Tensor,
    *,
    target_pos: Tensor,
    r_s_bias: Tensor | None = None,
    seg_embed: Tensor | None = None,
    q_seg: Tensor | None = None,
    k_seg: Tensor | None = None,
    attn_mask: Tensor | None = None,
    attn_mask_g: Tensor | None = None,
    q_rank: Tensor | None = None,
    k_rank: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Both XLNet streams in one launch; they share k, v and k_r.

    ``q_h (B, L, H, D)``: the content stream, one row per position, which also sees its own key.
    ``q_g (B, P, H, D)``: the query stream's target rows at ``target_pos (B, P)`` (negative =
    padding row), which do not see their own key. Segments: ``q_seg (B, L)`` (targets take theirs
    from it). Masks: ranks ``q_rank (B, L)``/``k_rank (B, K)`` for both streams, or dense
    ``attn_mask (B, L, K)`` for the content stream with ``attn_mask_g (B, P, K)`` for the targets.
    Returns ``(out_h (B, L, H, D), out_g (B, P, H, D))``; equal to two ``rel_attention`` calls.
    """
    _check_tensor("q_h", q_h, 4)
    B, L = q_h.shape[:2]
    _check_tensor("q_g", q_g, 4, (B, None) + tuple(q_h.shape[2:]), (q_h.dtype,), q_h.device)
    _int_tensor("target_pos", target_pos, (B, q_g.shape[1]), q_h.device)
    if (attn_mask is None) != (attn_mask_g is None):
        raise ValueError("attn_mask and attn_mask_g must be given together")
    rows = target_pos.long().clamp(min=0)
    q = torch.cat([q_h, q_g], dim=1)
    q_pos = torch.cat([torch.arange(L, device=q.device).expand(B, L), target_pos.long()], dim=1)
    if q_seg is not None:
        _int_tensor("q_seg", q_seg, (B, L), q.device)
        q_seg = torch.cat([q_seg, q_seg.gather(1, rows)], dim=1)
    if q_rank is not None:
        _int_tensor("q_rank", q_rank, (B, L), q.device, (torch.int32,))
        q_rank = torch.cat([q_rank, q_rank.gather(1, rows)], dim=1)
    if attn_mask is not None:
        attn_mask = torch.cat([attn_mask, attn_mask_g], dim=1)
    qlen, scale = _validate(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, q_seg, k_seg,
                            attn_mask, q_rank, k_rank, q_pos, L, scale, dropout_p)
    # every position 0..L-1 has a content row: the kernels may take every tile as banded
    out = _call(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, q_seg, k_seg, attn_mask,
                q_rank, k_rank, q_pos, qlen, L, scale, dropout_p, backend, rows_cover_qlen=True)
    return out[:, :L], out[:, L:]


def attention_probabilities(q, k, v, k_r, r_w_bias, r_r_bias, **kwargs) -> Tensor:
    """Eager attention probabilities ``(B, H, M, K)`` for the same arguments as ``rel_attention``
    (no dropout); used for ``output_attentions``."""
    kwargs = dict(kwargs)
    kwargs.pop("backend", None)
    kwargs.pop("dropout_p", None)
    B, M, H, D = q.shape
    qlen = kwargs.pop("qlen", None)
    qlen = M if qlen is None else qlen
    scale = _resolve_scale(kwargs.pop("scale", None), D)
    a = AttnArgs(kwargs.get("r_s_bias"), kwargs.get("seg_embed"), kwargs.get("q_seg"),
                 kwargs.get("k_seg"), kwargs.get("attn_mask"), kwargs.get("q_rank"),
                 kwargs.get("k_rank"), kwargs.get("q_pos"), qlen,
                 M if kwargs.get("self_visible", True) else 0,
                 scale, 0.0, None)
    return eager.probabilities(q, k, k_r, r_w_bias, r_r_bias, a)
