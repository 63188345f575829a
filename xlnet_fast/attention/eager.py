"""Eager (pure PyTorch) XLNet relative attention: the correctness oracle and the CPU path.

Layout inside this module: heads before positions, i.e. ``(B, H, M, D)``. Scores are formed in fp32
(float64 for float64 inputs) and never with reshape copies of the relative term: ``bd[i, j] =
raw[i, qlen + j - p_i]`` is read through a strided view (content stream) or a gather (target rows).

Forward saves only ``out`` and the row log-sum-exp; backward recomputes the probabilities, like
FlashAttention, so the per-layer memory kept for autograd is O(L), not O(L^2). A call's second
source of query rows (``q_g``, two-stream calls) is concatenated to q here; biases and seg_embed
are taken in q's dtype (they may come in float32 under autocast) and their gradients returned in
their own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .args import AttnArgs


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _all_rows(x: Tensor, x_g: Tensor | None) -> Tensor:
    """Rows [0, L) from ``x``, the rest from ``x_g`` (a two-stream call's query stream)."""
    return x if x_g is None else torch.cat([x, x_g.to(x.dtype)], dim=1)


def _taken(t: Tensor, q: Tensor, acc: torch.dtype) -> Tensor:
    """A bias parameter as the op computes with it: in q's dtype, then the accumulation dtype."""
    return t.to(q.dtype).to(acc)


def _rel_index(q_pos: Tensor | None, M: int, K: int, qlen: int, device) -> Tensor:
    """(B or 1, M, K) long: the k_r row ``qlen + j - p_i`` each score reads."""
    j = torch.arange(K, device=device)
    p = torch.arange(M, device=device)[None] if q_pos is None else q_pos.long()
    return qlen + j[None, None, :] - p[:, :, None]


def _uses_strided_shift(a: AttnArgs, M: int) -> bool:
    # p_i = i for every row: bd is a zero-copy strided view of the (M, R) product.
    return a.q_pos is None and M == a.qlen


def _shift(raw: Tensor, a: AttnArgs, K: int) -> tuple[Tensor, Tensor | None]:
    """raw (B, H, M, R) -> bd (B, H, M, K) with bd[..., i, j] = raw[..., i, qlen + j - p_i].

    Returns the view/gather and, for the gather path, the clamped index it used.
    """
    B, H, M, R = raw.shape
    if _uses_strided_shift(a, M):
        # Element (i, j) lives at i*R + qlen + j - i = i*(R-1) + j + qlen: a strided view.
        # Entries with qlen + j - i >= R (only "uni") spill into the next row; they are masked.
        raw = raw.contiguous()
        view = raw.as_strided((B, H, M, K), (H * M * R, M * R, R - 1, 1), raw.storage_offset() + a.qlen)
        return view, None
    idx = _rel_index(a.q_pos, M, K, a.qlen, raw.device).clamp(0, R - 1)
    idx = idx[:, None].expand(B, H, M, K)
    return raw.gather(-1, idx), idx


def _visible(a: AttnArgs, B: int, M: int, K: int, R: int, device) -> Tensor | None:
    """(B, M, K) bool of visible keys, or None when every key is visible."""
    mlen = K - a.qlen
    vis = None
    if a.attn_mask is not None:
        vis = ~a.attn_mask
    elif a.q_rank is not None:
        vis = a.k_rank[:, None, :] < a.q_rank[:, :, None]
        if a.self_rows > 0:
            j = torch.arange(K, device=device)
            p = torch.arange(M, device=device)[None] if a.q_pos is None else a.q_pos
            own = j[None, None, :] == (mlen + p)[:, :, None]
            if a.self_rows < M:
                own = own & (torch.arange(M, device=device) < a.self_rows)[None, :, None]
            vis = vis | own
    if R < K + a.qlen:
        # "uni": scores whose k_r row qlen + j - p_i is past the end are masked
        in_range = _rel_index(a.q_pos, M, K, a.qlen, device) < R
        vis = in_range if vis is None else vis & in_range
    if a.q_pos is not None:
        real_row = (a.q_pos >= 0)[:, :, None]
        vis = real_row if vis is None else vis & real_row
    if vis is not None:
        vis = vis.expand(B, M, K)
    return vis


def _scores(q, k, k_r, r_w_bias, r_r_bias, a: AttnArgs):
    """Masked, scaled scores (B, H, M, K) in the accumulation dtype, the visibility mask (or None),
    and what backward needs. The scale is folded into the (small) query operands."""
    acc = _acc_dtype(q.dtype)
    B, M, H, D = q.shape
    K, R = k.shape[1], k_r.shape[1]
    qf = q.to(acc).transpose(1, 2)
    kf = k.to(acc).transpose(1, 2)
    krf = k_r.to(acc).transpose(1, 2)
    q_w = qf + _taken(r_w_bias, q, acc)[:, None, :]
    q_r = qf + _taken(r_r_bias, q, acc)[:, None, :]
    s = torch.matmul(q_w * a.scale, kf.transpose(-1, -2))
    raw = torch.matmul(q_r * a.scale, krf.transpose(-1, -2))
    bd, idx = _shift(raw, a, K)
    s = s.add_(bd)
    del raw, bd
    seg_diff, q_s = None, None
    if a.seg_embed is not None:
        q_s = qf + _taken(a.r_s_bias, q, acc)[:, None, :]
        e = torch.matmul(q_s * a.scale, _taken(a.seg_embed, q, acc).permute(1, 2, 0))  # (B, H, M, 2)
        seg_diff = (a.q_seg[:, :, None] != a.k_seg[:, None, :])[:, None]
        s = s.add_(torch.where(seg_diff, e[..., 1:2], e[..., 0:1]))
    vis = _visible(a, B, M, K, R, q.device)
    if vis is not None:
        s = s.masked_fill_(~vis[:, None], float("-inf"))
    saved = dict(qf=qf, kf=kf, krf=krf, q_w=q_w, q_r=q_r, idx=idx, seg_diff=seg_diff, q_s=q_s)
    return s, vis, saved


def _dropout_keep(shape, a: AttnArgs, device) -> Tensor:
    if device.type == "meta":  # shapes only: no generator, no seed to read
        return torch.empty(shape, dtype=torch.bool, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(int(a.seed.item()))
    return torch.rand(shape, generator=gen, device=device) >= a.dropout_p


def forward(q, k, v, k_r, r_w_bias, r_r_bias, a: AttnArgs) -> tuple[Tensor, Tensor]:
    """Returns ``out (B, M, H, D)`` in q's dtype and ``lse (B, H, M)`` in the accumulation dtype
    (float32, or float64 for float64 inputs); +inf marks a row with no visible key. M counts q's
    rows and ``a.q_g``'s."""
    q = _all_rows(q, a.q_g)
    s, vis, _ = _scores(q, k, k_r, r_w_bias, r_r_bias, a)
    row_max = s.amax(-1)
    p = torch.softmax(s, dim=-1)
    del s
    # p_max = exp(row_max - lse), so lse = row_max - log(p_max): no second exp pass over the scores
    lse = row_max - p.amax(-1).log()
    if a.dropout_p > 0:
        p = p * _dropout_keep(p.shape, a, q.device) / (1.0 - a.dropout_p)
    out = torch.matmul(p, v.to(p.dtype).transpose(1, 2))
    if vis is not None:
        # rows with no visible key: softmax gave NaN; they output 0 and their lse is +inf
        has_key = vis.any(-1)[:, None]
        out = torch.where(has_key[..., None], out, 0.0)
        lse = torch.where(has_key, lse, float("inf"))
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse


def probabilities(q, k, k_r, r_w_bias, r_r_bias, a: AttnArgs) -> Tensor:
    """Attention probabilities (B, H, M, K) before dropout, for ``output_attentions``."""
    q = _all_rows(q, a.q_g)
    s, vis, _ = _scores(q, k, k_r, r_w_bias, r_r_bias, a)
    p = torch.softmax(s, dim=-1)
    if vis is None:
        return p
    # rows with no visible key are NaN; in place only where autograd does not need softmax's output
    return p.nan_to_num(0.0) if p.requires_grad else p.nan_to_num_(0.0)


def backward(dout, q, k, v, k_r, r_w_bias, r_r_bias, a: AttnArgs, out, lse, dout_g=None):
    """Gradients for q (all M rows: q's, then ``a.q_g``'s), k, v, k_r, r_w_bias, r_r_bias, r_s_bias,
    seg_embed (docs/DESIGN.md §3). ``dout`` covers out's rows [0, L) and ``dout_g`` the rest."""
    q = _all_rows(q, a.q_g)
    dout = _all_rows(dout, dout_g)
    s, _, sv = _scores(q, k, k_r, r_w_bias, r_r_bias, a)
    acc = s.dtype
    # lse is +inf on rows with no visible key, so those rows get p = 0 (not NaN)
    p = s.sub_(lse.to(acc)[..., None]).exp_()
    del s
    do = dout.to(acc).transpose(1, 2)
    vf = v.to(acc).transpose(1, 2)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    if a.dropout_p > 0:
        keep = _dropout_keep(p.shape, a, q.device).to(acc) / (1.0 - a.dropout_p)
        dv = torch.matmul((p * keep).transpose(-1, -2), do)
        dp = dp.mul_(keep)
    else:
        dv = torch.matmul(p.transpose(-1, -2), do)
    delta = (do * out.to(acc).transpose(1, 2)).sum(-1, keepdim=True)
    ds = p.mul_(dp.sub_(delta)).mul_(a.scale)  # dS, reusing p's storage
    del dp

    B, H, M, K = ds.shape
    R = k_r.shape[1]
    dq_w = torch.matmul(ds, sv["kf"])
    dk = torch.matmul(ds.transpose(-1, -2), sv["q_w"])
    draw = torch.zeros(B, H, M, R, dtype=acc, device=q.device)
    if sv["idx"] is None:
        draw.as_strided((B, H, M, K), (H * M * R, M * R, R - 1, 1), a.qlen).copy_(ds)
    else:
        draw.scatter_add_(-1, sv["idx"], ds)  # masked entries carry dS = 0
    dq_r = torch.matmul(draw, sv["krf"])
    dk_r = torch.matmul(draw.transpose(-1, -2), sv["q_r"])
    if k_r.shape[0] == 1 and B > 1:
        dk_r = dk_r.sum(0, keepdim=True)
    dq = dq_w + dq_r
    if a.seg_embed is not None:
        g1 = (ds * sv["seg_diff"]).sum(-1)
        g0 = ds.sum(-1) - g1
        seg = _taken(a.seg_embed, q, acc)
        dq_s = g0[..., None] * seg[0][:, None] + g1[..., None] * seg[1][:, None]
        dq = dq + dq_s
        dr_s = dq_s.sum((0, 2))
        dseg = torch.stack([(g[..., None] * sv["q_s"]).sum((0, 2)) for g in (g0, g1)])
    else:
        dr_s = torch.zeros_like(r_w_bias, dtype=acc)
        dseg = torch.zeros((2,) + tuple(r_w_bias.shape), dtype=acc, device=q.device)

    def bmhd(x, like):
        return x.transpose(1, 2).to(like.dtype)

    return (
        bmhd(dq, q),
        bmhd(dk, k),
        bmhd(dv, v),
        bmhd(dk_r, k_r),
        dq_w.sum((0, 2)).to(r_w_bias.dtype),
        dq_r.sum((0, 2)).to(r_r_bias.dtype),
        dr_s.to(r_w_bias.dtype if a.r_s_bias is None else a.r_s_bias.dtype),
        dseg.to(r_w_bias.dtype if a.seg_embed is None else a.seg_embed.dtype),
    )
