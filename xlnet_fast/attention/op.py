"""The public op ``rel_attention``: the ``torch.library`` ops, their autograd, and the entry points.

``rel_attention`` validates its arguments (``args.validate``), picks the backend, then calls
``torch.ops.xlnet_fast.rel_attention`` (forward: ``out`` and the row log-sum-exp), whose autograd
formula calls ``torch.ops.xlnet_fast.rel_attention_backward``. Both schemas are derived from the
fields of ``AttnArgs``: the dense tensors, then each field in order, then ``backend``. The masks come
prepared once for many calls (``masks=``, ``prepared.py``) or raw, prepared by the call.
"""

from __future__ import annotations


import dataclasses

import torch
from torch import Tensor

from . import eager
from .args import (DENSE_ARGS, AttnArgs, PreparedMasks, autocast_dtype, check_prepared, check_tensor, schema_fields,
                   validate)
from .backends import backend_for_call, run_backend, through_dispatcher
from .prepared import mask_tables_impl, prepare_two_stream_masks, triton_tables

_FIELDS = schema_fields()
_FIELD_NAMES = tuple(name for name, _ in _FIELDS)
_TENSOR_FIELDS = tuple(name for name, kind in _FIELDS if kind.startswith("Tensor"))
_GRADS = ("dq", "dk", "dv", "dk_r", "dr_w_bias", "dr_r_bias", "dr_s_bias", "dseg_embed")


def _schema(lead: tuple[str, ...], tail: tuple[str, ...], n_returns: int) -> str:
    """``tail``: trailing tensors, optional (``Tensor?``) where the name ends in ``?``."""
    params = ([f"Tensor {n}" for n in lead] + [f"{kind} {n}" for n, kind in _FIELDS] + ["str backend"]
              + [f"Tensor? {n[:-1]}" if n.endswith("?") else f"Tensor {n}" for n in tail])
    return f"({', '.join(params)}) -> ({', '.join(['Tensor'] * n_returns)})"


def _flatten(a: AttnArgs) -> tuple:
    return tuple(getattr(a, name) for name in _FIELD_NAMES)


def _unpack(args: tuple, n_lead: int) -> tuple[tuple, AttnArgs, str, tuple]:
    """An op call's positional arguments as (leading tensors, record, backend, trailing tensors)."""
    end = n_lead + len(_FIELD_NAMES)
    record = AttnArgs(**dict(zip(_FIELD_NAMES, args[n_lead:end])))
    return args[:n_lead], record, args[end], args[end + 1:]


def _rows(q: Tensor, a: AttnArgs) -> int:
    """M, the call's query rows: q's and q_g's."""
    return q.shape[1] + (a.q_g.shape[1] if a.q_g is not None else 0)


# --------------------------------------------------------------------------------------------------
# The torch.library ops
# --------------------------------------------------------------------------------------------------


def _forward_impl(*args) -> tuple[Tensor, Tensor]:
    dense, a, backend, _ = _unpack(args, len(DENSE_ARGS))
    return run_backend(backend, "forward", *dense, a)


def _forward_fake(*args) -> tuple[Tensor, Tensor]:
    (q, *_), a, _, _ = _unpack(args, len(DENSE_ARGS))
    B, _, H, D = q.shape
    M = _rows(q, a)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((B, M, H, D)), q.new_empty((B, H, M), dtype=lse_dtype)


def _backward_impl(*args) -> tuple[Tensor, ...]:
    (dout, *dense), a, backend, (out, lse, dout_g) = _unpack(args, 1 + len(DENSE_ARGS))
    return _backward_record(dout, dense, a, backend, out, lse, dout_g)


def _backward_record(dout, dense, a: AttnArgs, backend: str, out, lse, dout_g) -> tuple[Tensor, ...]:
    grads = run_backend(backend, "backward", dout, *dense, a, out, lse, dout_g)
    return tuple(g.contiguous() for g in grads)


def _backward_fake(*args) -> tuple[Tensor, ...]:
    (_, q, k, v, k_r, r_w_bias, r_r_bias), a, _, _ = _unpack(args, 1 + len(DENSE_ARGS))
    seg_like = a.seg_embed if a.seg_embed is not None else r_w_bias.new_empty((2,) + tuple(r_w_bias.shape))
    bias_like = a.r_s_bias if a.r_s_bias is not None else r_w_bias
    dq = q.new_empty((q.shape[0], _rows(q, a)) + tuple(q.shape[2:]))
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in (dq, k, v, k_r, r_w_bias, r_r_bias, bias_like, seg_like))


_forward_op = torch.library.custom_op("xlnet_fast::rel_attention", _forward_impl, mutates_args=(),
                                      schema=_schema(DENSE_ARGS, (), 2))
_forward_op.register_fake(_forward_fake)
# dout: the gradient of out's rows [0, L) (all M without q_g), dout_g of the rest (with q_g)
_backward_op = torch.library.custom_op("xlnet_fast::rel_attention_backward", _backward_impl, mutates_args=(),
                                       schema=_schema(("dout",) + DENSE_ARGS, ("out", "lse", "dout_g?"), len(_GRADS)))
_backward_op.register_fake(_backward_fake)
# the real implementations by op name (bench.host_cost runs them on meta tensors)
REAL_IMPLEMENTATIONS = {"rel_attention": _forward_impl, "rel_attention_backward": _backward_impl,
                        "mask_tables": mask_tables_impl}


def _setup_context(ctx, inputs, output) -> None:
    dense, a, backend, _ = _unpack(inputs, len(DENSE_ARGS))
    ctx.backend, ctx.q_rows = backend, dense[0].shape[1]
    ctx.record = dataclasses.replace(a, **dict.fromkeys(_TENSOR_FIELDS))  # tensors go to saved_tensors
    ctx.save_for_backward(*dense, *(getattr(a, n) for n in _TENSOR_FIELDS), *output)


def _backward(ctx, dout, _dlse):
    saved = ctx.saved_tensors
    n = len(DENSE_ARGS)
    dense, field_tensors, (out, lse) = saved[:n], saved[n:-2], saved[-2:]
    a = dataclasses.replace(ctx.record, **dict(zip(_TENSOR_FIELDS, field_tensors)))
    dout_g = None
    if a.q_g is not None:  # out's rows past q's are q_g's
        dout, dout_g = dout[:, :ctx.q_rows], dout[:, ctx.q_rows:]
    grads = dict(zip(_GRADS, torch.ops.xlnet_fast.rel_attention_backward(
        dout, *dense, *_flatten(a), ctx.backend, out, lse, dout_g)))
    fields = dict.fromkeys(_FIELD_NAMES)
    if a.has_segments:
        fields.update(r_s_bias=grads["dr_s_bias"], seg_embed=grads["dseg_embed"])
    if a.q_g is not None:
        grads["dq"], fields["q_g"] = grads["dq"][:, :ctx.q_rows], grads["dq"][:, ctx.q_rows:]
    return (*(grads[g] for g in _GRADS[:n]), *fields.values(), None)  # None: backend


# The op called directly (torch.ops.xlnet_fast.rel_attention) differentiates through this formula;
# the entry points below take the same ops through _RelAttention.
_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _RelAttention(torch.autograd.Function):
    """The entry points' autograd boundary: the two ops, their saved tensors and the formula of
    ``register_autograd`` without torch's generic wrapper around them (~220 µs per call in grad mode
    against ~45 here: bench/NOTES.md), and in eager mode without the dispatcher
    (``backends.through_dispatcher``). Its tensor arguments are the differentiable ones; the record ``a``
    (validated: masks, their tables, the seed, the scalars) rides along. Returns ``out``, or with
    ``q_g`` its rows [0, L) and [L, M) apart (views), whose gradients reach the backward op apart,
    never concatenated."""

    @staticmethod
    def forward(ctx, backend: str, a: AttnArgs, q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, q_g):
        dense = (q, k, v, k_r, r_w_bias, r_r_bias)
        if through_dispatcher((*dense, r_s_bias, seg_embed, q_g)):
            out, lse = torch.ops.xlnet_fast.rel_attention(*dense, *_flatten(a), backend)
        else:
            out, lse = run_backend(backend, "forward", *dense, a)
        # the record keeps the masks (O(L), prepared once for a forward's layers) and the scalars; the
        # differentiable tensors are saved (its references to them keep nothing else alive)
        ctx.backend, ctx.record = backend, a
        ctx.save_for_backward(*dense, r_s_bias, seg_embed, q_g, out, lse)
        if q_g is None:
            return out
        return tuple(out.split([q.shape[1], q_g.shape[1]], dim=1))

    @staticmethod
    def backward(ctx, dout, dout_g=None):
        q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, q_g, out, lse = ctx.saved_tensors
        dense = (q, k, v, k_r, r_w_bias, r_r_bias)
        a = ctx.record
        if through_dispatcher((*dense, r_s_bias, seg_embed, q_g)):
            grads = torch.ops.xlnet_fast.rel_attention_backward(dout, *dense, *_flatten(a), ctx.backend, out, lse,
                                                                dout_g)
        else:
            grads = _backward_record(dout, dense, a, ctx.backend, out, lse, dout_g)
        dq, dk, dv, dk_r, dr_w, dr_r, dr_s, dseg = grads
        dq_g = None
        if q_g is not None:
            dq, dq_g = dq[:, :q.shape[1]], dq[:, q.shape[1]:]
        if seg_embed is None:
            dr_s = dseg = None
        return None, None, dq, dk, dv, dk_r, dr_w, dr_r, dr_s, dseg, dq_g


# --------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------


def _autocast(*tensors):
    """``tensors`` as the op computes on them: under ``torch.autocast`` on the first one's device, the
    floating ones in the autocast dtype (the op is a product of matrices, like ``torch.matmul``);
    otherwise, and for anything that is not a floating tensor, as given. The biases and seg_embed
    are not cast (a model's bias parameters stay float32 under autocast): the op takes them in q's
    dtype itself, and their gradients come back in their own dtype."""
    lead = tensors[0]
    dtype = autocast_dtype(lead.device.type) if isinstance(lead, Tensor) else None
    if dtype is None:
        return tensors, False
    return tuple(t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t for t in tensors), True


def dropout_seed(device: torch.device, backend: str) -> Tensor:
    """A call's dropout seed, 48 random bits: for the Triton backend from torch's generator of
    ``device``, drawn there (no host sync; a CUDA graph that captured the call draws a new one at
    each replay); for the eager backend from the CPU's, which it seeds a generator with."""
    if backend == "triton":
        return torch.randint(0, 2**48, (), dtype=torch.int64, device=device)
    return torch.randint(0, 2**48, (), dtype=torch.int64)


def _call(dense: tuple[Tensor, ...], a: AttnArgs, backend: str):
    resolved = backend_for_call(backend, *dense[:4])
    if a.dropout_p > 0:
        if (resolved != "triton" and dense[0].is_cuda and not torch.compiler.is_compiling()
                and torch.cuda.is_current_stream_capturing()):
            # the eager backend's seed is drawn on the host: a graph would replay its first value
            raise RuntimeError("rel_attention with dropout_p > 0 cannot be captured in a CUDA graph on the eager "
                               "backend: its dropout seed is drawn on the host, so every replay would drop the same "
                               "scores; use the Triton backend, capture with dropout_p=0 (model.eval()), or leave "
                               "the step uncaptured")
        a.seed = dropout_seed(dense[0].device, resolved)  # a: this call's own record (validate's)
    if resolved == "triton" and a.rows_table is None:
        a.rows_table, a.keys_table = triton_tables(a, dense[0].shape[0], _rows(dense[0], a), dense[1].shape[1],
                                                   dense[0].device)
    return _RelAttention.apply(resolved, a, *dense, a.r_s_bias, a.seg_embed, a.q_g)


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
    masks: PreparedMasks | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> Tensor:
    """XLNet relative attention (docs/DESIGN.md §2, §4). Returns ``(B, M, H, D)`` in q's dtype.

    q: ``(B, M, H, D)`` query rows (float32, bfloat16, float16; float64 on the eager backend).
    k, v: ``(B, K, H, D)``, ``K = mlen + qlen``, memory first.
    k_r: ``(Br, R, H, D)``, ``Br in {1, B}``, ``R >= K + 1``: projected relative positions K, K-1, ...,
    K - R + 1 (query-key distances); a key whose distance has no row is not visible: ``R = K + 1``
    is causal attention (transformers' ``attn_type="uni"``), ``R >= K + qlen`` sees every key.
    r_w_bias, r_r_bias: ``(H, D)`` content and position biases.
    r_s_bias: ``(H, D)``, seg_embed: ``(2, H, D)``, q_seg: ``(B, M)``, k_seg: ``(B, K)`` int: the
    segment term (all four or none).
    attn_mask: ``(B, M, K)`` bool, True = blocked; or the rank masks:
    q_rank: ``(B, M)``, k_rank: ``(B, K)`` int32: key j is visible to query i iff
    ``k_rank[j] < q_rank[i]``, or ``self_visible`` and j is the query's own key ``mlen + p_i``
    (``self_visible`` is part of the rank rule: without masks every key is visible, as in
    transformers, and an attn_mask says everything itself).
    q_pos: ``(B, M)`` int position of each query row in the current segment (negative = padding
    row, output 0); default ``arange(M)`` with ``qlen = M``.
    qlen: int, the current segment's length (default M).
    masks: the masks above prepared once for many calls (``xlnet_fast.prepare_masks``), instead of
    q_seg, k_seg, attn_mask, q_rank, k_rank, self_visible, q_pos and qlen.
    scale: float, default ``1/sqrt(D)``. dropout_p: float in [0, 1) on the probabilities.
    backend: ``"auto"``, ``"eager"`` or ``"triton"`` (forced: never falls back).
    Under ``torch.autocast`` the float tensors are taken in the autocast dtype. Scores are fp32; with
    16-bit inputs the Triton kernels round the position term to bf16 (as autocast's products are),
    the eager backend does not.
    """
    (q, k, v, k_r), autocast = _autocast(q, k, v, k_r)
    a = validate(q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias=r_s_bias, seg_embed=seg_embed, q_seg=q_seg,
                 k_seg=k_seg, attn_mask=attn_mask, q_rank=q_rank, k_rank=k_rank, q_pos=q_pos, qlen=qlen,
                 self_visible=self_visible, masks=masks, scale=scale, dropout_p=dropout_p, bias_autocast=autocast)
    return _call((q, k, v, k_r, r_w_bias, r_r_bias), a, backend)


_TWO_STREAM_MASKS = ("target_pos", "q_seg", "k_seg", "attn_mask", "attn_mask_g", "q_rank", "k_rank")


def rel_attention_two_stream(
    q_h: Tensor,
    q_g: Tensor,
    k: Tensor,
    v: Tensor,
    k_r: Tensor,
    r_w_bias: Tensor,
    r_r_bias: Tensor,
    *,
    target_pos: Tensor | None = None,
    r_s_bias: Tensor | None = None,
    seg_embed: Tensor | None = None,
    q_seg: Tensor | None = None,
    k_seg: Tensor | None = None,
    attn_mask: Tensor | None = None,
    attn_mask_g: Tensor | None = None,
    q_rank: Tensor | None = None,
    k_rank: Tensor | None = None,
    masks: PreparedMasks | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Both XLNet streams in one launch; they share k, v and k_r. Equal to two ``rel_attention`` calls.

    q_h: ``(B, L, H, D)`` the content stream, one row per position, which also sees its own key.
    q_g: ``(B, P, H, D)`` the query stream's target rows, which do not see their own key under the
    rank masks (without masks every row sees every key, as in transformers; attn_mask_g decides with
    dense masks).
    target_pos: ``(B, P)`` int position of each target row (negative = padding row).
    q_seg: ``(B, L)`` segments of the positions (target rows take theirs from it); k_seg: ``(B, K)``.
    q_rank: ``(B, L)``, k_rank: ``(B, K)`` int32 ranks for both streams; or dense
    attn_mask: ``(B, L, K)`` for the content stream with attn_mask_g: ``(B, P, K)`` for the targets.
    masks: the masks above prepared once for many calls (``xlnet_fast.prepare_two_stream_masks``),
    instead of target_pos, q_seg, k_seg, attn_mask, attn_mask_g, q_rank and k_rank.
    The other arguments as in ``rel_attention``. Returns ``(out_h (B, L, H, D), out_g (B, P, H, D))``.
    """
    (q_h, q_g, k, v, k_r), autocast = _autocast(q_h, q_g, k, v, k_r)
    check_tensor("q_h", q_h, 4)  # (q_g: validate checks it against q_h)
    B, L = q_h.shape[:2]
    raw = (target_pos, q_seg, k_seg, attn_mask, attn_mask_g, q_rank, k_rank)
    check_prepared(masks)
    if masks is None:
        if target_pos is None:
            raise ValueError("rel_attention_two_stream needs target_pos (or masks= prepared with it)")
        check_tensor("k", k, 4)
        masks = prepare_two_stream_masks(B, L, k.shape[1], device=q_h.device, backend="eager",
                                         **dict(zip(_TWO_STREAM_MASKS, raw)))
    elif any(t is not None for t in raw):
        raise ValueError("pass the masks prepared (masks=) or as keywords, not both: got masks and "
                         f"{[name for name, t in zip(_TWO_STREAM_MASKS, raw) if t is not None]}")
    if not masks.rows_cover_qlen or masks.self_rows != L:
        raise ValueError("rel_attention_two_stream's masks= must come from prepare_two_stream_masks with qlen = "
                         f"{L} (q_h's rows)")
    a = validate(q_h, k, v, k_r, r_w_bias, r_r_bias, r_s_bias=r_s_bias, seg_embed=seg_embed, q_g=q_g, masks=masks,
                 scale=scale, dropout_p=dropout_p, bias_autocast=autocast)
    out_h, out_g = _call((q_h, k, v, k_r, r_w_bias, r_r_bias), a, backend)
    return out_h, out_g


def attention_probabilities(q, k, v, k_r, r_w_bias, r_r_bias, **kwargs) -> Tensor:
    """Eager attention probabilities ``(B, H, M, K)`` for ``rel_attention``'s arguments, before
    dropout (``dropout_p`` and ``backend`` are ignored); used for ``output_attentions``."""
    kwargs = {name: value for name, value in kwargs.items() if name not in ("backend", "dropout_p")}
    (q, k, v, k_r), autocast = _autocast(q, k, v, k_r)
    a = validate(q, k, v, k_r, r_w_bias, r_r_bias, bias_autocast=autocast, **kwargs)
    return eager.probabilities(q, k, k_r, r_w_bias, r_r_bias, a)
