"""The public op ``rel_attention``: the ``torch.library`` ops, their autograd, and the entry points.

``rel_attention`` validates its arguments (``args.validate``), picks the backend, then calls
``torch.ops.xlnet_fast.rel_attention`` (forward: ``out`` and the row log-sum-exp), whose autograd
formula calls ``torch.ops.xlnet_fast.rel_attention_backward``. Both schemas are derived from the
fields of ``AttnArgs``: the dense tensors, then each field in order, then ``backend``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import eager
from .args import DENSE_ARGS, AttnArgs, check_index_tensor, check_tensor, schema_fields, validate
from .backends import backend_for_call, run_backend

_FIELDS = schema_fields()
_FIELD_NAMES = tuple(name for name, _ in _FIELDS)
_TENSOR_FIELDS = tuple(name for name, kind in _FIELDS if kind.startswith("Tensor"))
_GRADS = ("dq", "dk", "dv", "dk_r", "dr_w_bias", "dr_r_bias", "dr_s_bias", "dseg_embed")


def _schema(lead: tuple[str, ...], tail: tuple[str, ...], n_returns: int) -> str:
    params = ([f"Tensor {n}" for n in lead] + [f"{kind} {n}" for n, kind in _FIELDS] + ["str backend"]
              + [f"Tensor {n}" for n in tail])
    return f"({', '.join(params)}) -> ({', '.join(['Tensor'] * n_returns)})"


def _flatten(a: AttnArgs) -> tuple:
    return tuple(getattr(a, name) for name in _FIELD_NAMES)


def _unpack(args: tuple, n_lead: int) -> tuple[tuple, AttnArgs, str, tuple]:
    """An op call's positional arguments as (leading tensors, record, backend, trailing tensors)."""
    end = n_lead + len(_FIELD_NAMES)
    record = AttnArgs(**dict(zip(_FIELD_NAMES, args[n_lead:end])))
    return args[:n_lead], record, args[end], args[end + 1:]


# --------------------------------------------------------------------------------------------------
# The torch.library ops
# --------------------------------------------------------------------------------------------------


def _forward_impl(*args) -> tuple[Tensor, Tensor]:
    dense, a, backend, _ = _unpack(args, len(DENSE_ARGS))
    return run_backend(backend, "forward", *dense, a)


def _forward_fake(*args) -> tuple[Tensor, Tensor]:
    (q, *_), _, _, _ = _unpack(args, len(DENSE_ARGS))
    B, M, H, D = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((B, M, H, D)), q.new_empty((B, H, M), dtype=lse_dtype)


def _backward_impl(*args) -> tuple[Tensor, ...]:
    (dout, *dense), a, backend, (out, lse) = _unpack(args, 1 + len(DENSE_ARGS))
    grads = run_backend(backend, "backward", dout, *dense, a, out, lse)
    return tuple(g.contiguous() for g in grads)


def _backward_fake(*args) -> tuple[Tensor, ...]:
    (_, q, k, v, k_r, r_w_bias, r_r_bias), a, _, _ = _unpack(args, 1 + len(DENSE_ARGS))
    seg_like = a.seg_embed if a.seg_embed is not None else r_w_bias.new_empty((2,) + tuple(r_w_bias.shape))
    bias_like = a.r_s_bias if a.r_s_bias is not None else r_w_bias
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (q, k, v, k_r, r_w_bias, r_r_bias, bias_like, seg_like))


_forward_op = torch.library.custom_op("xlnet_fast::rel_attention", _forward_impl, mutates_args=(),
                                      schema=_schema(DENSE_ARGS, (), 2))
_forward_op.register_fake(_forward_fake)
_backward_op = torch.library.custom_op("xlnet_fast::rel_attention_backward", _backward_impl, mutates_args=(),
                                       schema=_schema(("dout",) + DENSE_ARGS, ("out", "lse"), len(_GRADS)))
_backward_op.register_fake(_backward_fake)


def _setup_context(ctx, inputs, output) -> None:
    dense, a, backend, _ = _unpack(inputs, len(DENSE_ARGS))
    out, lse = output
    ctx.record = dataclasses.replace(a, **dict.fromkeys(_TENSOR_FIELDS))  # tensors go to saved_tensors
    ctx.backend = backend
    ctx.save_for_backward(*dense, *(getattr(a, n) for n in _TENSOR_FIELDS), out, lse)


def _backward(ctx, dout, _dlse):
    saved = ctx.saved_tensors
    n = len(DENSE_ARGS)
    dense, field_tensors, (out, lse) = saved[:n], saved[n:-2], saved[-2:]
    a = dataclasses.replace(ctx.record, **dict(zip(_TENSOR_FIELDS, field_tensors)))
    grads = dict(zip(_GRADS, torch.ops.xlnet_fast.rel_attention_backward(dout, *dense, *_flatten(a), ctx.backend,
                                                                         out, lse)))
    field_grads = dict.fromkeys(_FIELD_NAMES)
    if a.has_segments:
        field_grads.update(r_s_bias=grads["dr_s_bias"], seg_embed=grads["dseg_embed"])
    return (*(grads[g] for g in _GRADS[:len(DENSE_ARGS)]), *field_grads.values(), None)  # None: backend


_forward_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------


def _autocast(*tensors):
    """``tensors`` as the op computes on them: under ``torch.autocast`` on the first one's device, the
    floating ones in the autocast dtype (the op is a product of matrices, like ``torch.matmul``; a
    model's bias parameters stay float32 there while its projections come out in the autocast
    dtype); otherwise, and for anything that is not a floating tensor, as given."""
    lead = tensors[0]
    if not isinstance(lead, Tensor) or not torch.is_autocast_enabled(lead.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(lead.device.type)
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in tensors)


def _call(dense: tuple[Tensor, ...], a: AttnArgs, backend: str) -> Tensor:
    resolved = backend_for_call(backend, *dense[:4])
    if a.dropout_p > 0:
        if dense[0].is_cuda and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
            # the seed below is drawn on the host: a graph would replay its first value, one mask
            # (not checked while torch.compile traces, where the query cannot be folded)
            raise RuntimeError("rel_attention with dropout_p > 0 cannot be captured in a CUDA graph: its "
                               "dropout seed is drawn on the host, so every replay would drop the same "
                               "scores; capture with dropout_p=0 (model.eval()) or leave the step uncaptured")
        a = dataclasses.replace(a, seed=torch.randint(0, 2**62, (), dtype=torch.int64))
    out, _ = torch.ops.xlnet_fast.rel_attention(*dense, *_flatten(a), resolved)
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

    q: ``(B, M, H, D)`` query rows (float32, bfloat16, float16; float64 on the eager backend).
    k, v: ``(B, K, H, D)``, ``K = mlen + qlen``, memory first.
    k_r: ``(Br, R, H, D)``, ``Br in {1, B}``, ``R >= K + 1``: projected relative positions K, K-1, ...
    r_w_bias, r_r_bias: ``(H, D)`` content and position biases.
    r_s_bias: ``(H, D)``, seg_embed: ``(2, H, D)``, q_seg: ``(B, M)``, k_seg: ``(B, K)`` int: the
    segment term (all four or none).
    attn_mask: ``(B, M, K)`` bool, True = blocked; or the rank masks:
    q_rank: ``(B, M)``, k_rank: ``(B, K)`` int32: key j is visible to query i iff
    ``k_rank[j] < q_rank[i]``, or ``self_visible`` and j is the query's own key ``mlen + p_i``.
    q_pos: ``(B, M)`` int position of each query row in the current segment (negative = padding
    row, output 0); default ``arange(M)`` with ``qlen = M``.
    qlen: int, the current segment's length (default M).
    scale: float, default ``1/sqrt(D)``. dropout_p: float in [0, 1) on the probabilities.
    backend: ``"auto"``, ``"eager"`` or ``"triton"`` (forced: never falls back).
    Under ``torch.autocast`` the float tensors are taken in the autocast dtype.
    """
    q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed = _autocast(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias,
                                                                      seg_embed)
    a = validate(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias=r_s_bias, seg_embed=seg_embed, q_seg=q_seg,
                 k_seg=k_seg, attn_mask=attn_mask, q_rank=q_rank, k_rank=k_rank, q_pos=q_pos, qlen=qlen,
                 self_visible=self_visible, scale=scale, dropout_p=dropout_p)
    return _call((q, k, v, k_r, r_w_bias, r_r_bias), a, backend)


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
    """Both XLNet streams in one launch; they share k, v and k_r. Equal to two ``rel_attention`` calls.

    q_h: ``(B, L, H, D)`` the content stream, one row per position, which also sees its own key.
    q_g: ``(B, P, H, D)`` the query stream's target rows, which do not see their own key.
    target_pos: ``(B, P)`` int position of each target row (negative = padding row).
    q_seg: ``(B, L)`` segments of the positions (target rows take theirs from it); k_seg: ``(B, K)``.
    q_rank: ``(B, L)``, k_rank: ``(B, K)`` int32 ranks for both streams; or dense
    attn_mask: ``(B, L, K)`` for the content stream with attn_mask_g: ``(B, P, K)`` for the targets.
    The other arguments as in ``rel_attention``. Returns ``(out_h (B, L, H, D), out_g (B, P, H, D))``.
    """
    q_h, q_g, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed = _autocast(q_h, q_g, k, v, k_r, r_w_bias, r_r_bias,
                                                                             r_s_bias, seg_embed)
    check_tensor("q_h", q_h, 4)
    B, L = q_h.shape[:2]
    check_tensor("q_g", q_g, 4, (B, None) + tuple(q_h.shape[2:]), (q_h.dtype,), q_h.device)
    check_index_tensor("target_pos", target_pos, (B, q_g.shape[1]), q_h.device)
    if (attn_mask is None) != (attn_mask_g is None):
        raise ValueError("attn_mask and attn_mask_g must be given together")
    rows = target_pos.long().clamp(min=0)
    q = torch.cat([q_h, q_g], dim=1)
    q_pos = torch.cat([torch.arange(L, device=q.device).expand(B, L), target_pos.long()], dim=1)
    if q_seg is not None:
        check_index_tensor("q_seg", q_seg, (B, L), q.device)
        q_seg = torch.cat([q_seg, q_seg.gather(1, rows)], dim=1)
    if q_rank is not None:
        check_index_tensor("q_rank", q_rank, (B, L), q.device, (torch.int32,))
        q_rank = torch.cat([q_rank, q_rank.gather(1, rows)], dim=1)
    if attn_mask is not None:
        attn_mask = torch.cat([attn_mask, attn_mask_g], dim=1)
    # the content rows (the first L) see their own key, the target rows do not; every position
    # 0..L-1 has a content row, so the kernels may take every tile as banded
    a = validate(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias=r_s_bias, seg_embed=seg_embed, q_seg=q_seg,
                 k_seg=k_seg, attn_mask=attn_mask, q_rank=q_rank, k_rank=k_rank, q_pos=q_pos, qlen=L,
                 self_rows=L, scale=scale, dropout_p=dropout_p, rows_cover_qlen=True)
    out = _call((q, k, v, k_r, r_w_bias, r_r_bias), a, backend)
    return out[:, :L], out[:, L:]


def attention_probabilities(q, k, v, k_r, r_w_bias, r_r_bias, **kwargs) -> Tensor:
    """Eager attention probabilities ``(B, H, M, K)`` for ``rel_attention``'s arguments, before
    dropout (``dropout_p`` and ``backend`` are ignored); used for ``output_attentions``."""
    kwargs = {name: value for name, value in kwargs.items() if name not in ("backend", "dropout_p")}
    q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed = _autocast(
        q, k, v, k_r, r_w_bias, r_r_bias, kwargs.pop("r_s_bias", None), kwargs.pop("seg_embed", None))
    a = validate(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias=r_s_bias, seg_embed=seg_embed, **kwargs)
    return eager.probabilities(q, k, k_r, r_w_bias, r_r_bias, a)
