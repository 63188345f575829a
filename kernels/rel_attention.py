"""Fused XLNet relative attention in Triton: forward and backward (FlashAttention-2 scheme).

Per (query tile, key tile) the score tile is built in registers and never written out:

* content term ``(q + r_w_bias) . k`` — one ``tl.dot``;
* relative term ``(q + r_r_bias) . k_r[qlen + j - p_i]`` — the shift is done on the fly: for the
  k_r rows the tile needs (a window of ``BLOCK_N + span(p) - 1`` rows, taken in chunks of
  ``BLOCK_N``), ``raw = q_r @ k_r_chunk^T`` is skewed into the tile with ``tl.gather``;
* segment term — two per-row scalars ``(q + r_s_bias) . seg_embed[0/1]`` picked by segment equality;
* masks — compact ranks (``k_rank[j] < q_rank[i]``, or the query's own key for rows < ``self_rows``), a
  dense bool tile, padding rows (``q_pos < 0``), k_r rows past the end ("uni").

Softmax is online in base 2 (``exp2``) with fp32 statistics; attention dropout uses Philox
(``tl.rand``) keyed by (seed, batch*head) and counted by ``i * K + j``, regenerated in backward.
Backward: ``delta = rowsum(dO * O)``, then one kernel per key tile (dK, dV, and dk_r through the
inverse skew, with fp32 atomics along the k_r rows) and one per query tile (dQ and the per-tile
sums that give the bias and seg_embed gradients). ``deterministic=True`` replaces the dk_r atomics by
a kernel that owns a tile of k_r rows and recomputes the scores that map onto it.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(ptr, stride, rows, row_ok, other):
    return tl.load(ptr + rows * stride, mask=row_ok, other=other)


@triton.jit
def _query_tile(q_base, stride_qm, rows, row_ok, offs_d, d_ok, bias_w_ptr, bias_r_ptr, bias_s_ptr,
                seg_ptr, stride_seg, HAS_SEG: tl.constexpr):
    """q + r_w_bias, q + r_r_bias, q + r_s_bias (fp32, (BLOCK_M, BLOCK_D)) and the per-row segment
    scores (q + r_s_bias) . seg_embed[0/1]."""
    q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q_w = q + tl.load(bias_w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    q_r = q + tl.load(bias_r_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_SEG:
        q_s = q + tl.load(bias_s_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        seg0 = tl.load(seg_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        seg1 = tl.load(seg_ptr + stride_seg + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        e0 = tl.sum(q_s * seg0[None, :], axis=1)
        e1 = tl.sum(q_s * seg1[None, :], axis=1)
    else:
        q_s = q
        e0 = tl.sum(q * 0.0, axis=1)
        e1 = e0
    return q_w, q_r, q_s, e0, e1


@triton.jit
def _query_side(q_ptr, qpos_ptr, qseg_ptr, qrank_ptr, bias_w_ptr, bias_r_ptr, bias_s_ptr, seg_ptr,
                b, h, rows, offs_d, d_ok, M, stride_qb, stride_qm, stride_qh, stride_qpb, stride_qpm,
                stride_qsb, stride_qsm, stride_qrb, stride_qrm, stride_bh, stride_seg, stride_segh,
                HAS_SEG: tl.constexpr, MASK_MODE: tl.constexpr, HAS_QPOS: tl.constexpr):
    """A query tile's positions (padding rows: p < 0), biased queries, segment scores, segment ids
    and ranks."""
    row_in = rows < M
    if HAS_QPOS:
        p = _load_rows(qpos_ptr + b * stride_qpb, stride_qpm, rows, row_in, -1).to(tl.int32)
    else:
        p = rows
    row_ok = row_in & (p >= 0)
    q_w, q_r, q_s, e0, e1 = _query_tile(q_ptr + b * stride_qb + h * stride_qh, stride_qm, rows,
                                        row_in, offs_d, d_ok, bias_w_ptr + h * stride_bh,
                                        bias_r_ptr + h * stride_bh, bias_s_ptr + h * stride_bh,
                                        seg_ptr + h * stride_segh, stride_seg, HAS_SEG)
    q_seg = _load_rows(qseg_ptr + b * stride_qsb, stride_qsm, rows, row_in, 0) if HAS_SEG else rows
    q_rank = _load_rows(qrank_ptr + b * stride_qrb, stride_qrm, rows, row_in, 0) if MASK_MODE == 2 else rows
    return p, row_ok, q_w, q_r, q_s, e0, e1, q_seg, q_rank


@triton.jit
def _window(p, row_ok, n0, qlen, R, BLOCK_N: tl.constexpr):
    """First and one-past-last k_r row that the (query tile, key tile at n0) pair reads."""
    p_hi = tl.max(tl.where(row_ok, p, -1), axis=0)
    p_lo = tl.min(tl.where(row_ok, p, qlen), axis=0)
    c_lo = tl.maximum(qlen + n0 - p_hi, 0)
    c_hi = tl.minimum(qlen + n0 + BLOCK_N - p_lo, R)
    return c_lo, c_hi


@triton.jit
def _scores(q_w, q_r, e0, e1, p, row_ok, q_seg, q_rank, k_tile, n0,
            kr_base, stride_krr, kseg_base, stride_ksk, krank_base, stride_krk,
            mask_base, stride_mm, stride_mk, rows, offs_d, d_ok,
            K, R, qlen, mlen, self_rows, qk_scale,
            HAS_SEG: tl.constexpr, MASK_MODE: tl.constexpr, SELF_VISIBLE: tl.constexpr,
            CHECK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
            INPUT_PRECISION: tl.constexpr):
    """Scaled (log2 domain) score tile (BLOCK_M, BLOCK_N) with -inf where a key is not visible."""
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < K
    s = tl.dot(q_w.to(DOT_DTYPE), tl.trans(k_tile), input_precision=INPUT_PRECISION)
    # relative term: bd[i, j] = raw[i, qlen + j - p_i], gathered chunk by chunk of k_r rows
    rel = qlen + cols[None, :] - p[:, None]
    c_lo, c_hi = _window(p, row_ok, n0, qlen, R, BLOCK_N)
    q_r_dot = q_r.to(DOT_DTYPE)
    for c0 in range(c_lo, c_hi, BLOCK_N):
        c_rows = c0 + tl.arange(0, BLOCK_N)
        kr = tl.load(kr_base + c_rows[:, None] * stride_krr + offs_d[None, :],
                     mask=(c_rows < R)[:, None] & d_ok[None, :], other=0.0)
        raw = tl.dot(q_r_dot, tl.trans(kr.to(DOT_DTYPE)), input_precision=INPUT_PRECISION)
        idx = rel - c0
        in_chunk = (idx >= 0) & (idx < BLOCK_N)
        s += tl.where(in_chunk, tl.gather(raw, tl.where(in_chunk, idx, 0), axis=1), 0.0)
    if HAS_SEG:
        k_seg = tl.load(kseg_base + cols * stride_ksk, mask=col_ok, other=0)
        s += tl.where(q_seg[:, None] != k_seg[None, :], e1[:, None], e0[:, None])
    s = s * qk_scale
    visible = row_ok[:, None] & col_ok[None, :]
    if MASK_MODE == 1:
        blocked = tl.load(mask_base + rows[:, None] * stride_mm + cols[None, :] * stride_mk,
                          mask=visible, other=1)
        visible = visible & (blocked == 0)
    if MASK_MODE == 2:
        k_rank = tl.load(krank_base + cols * stride_krk, mask=col_ok, other=0)
        seen = k_rank[None, :] < q_rank[:, None]
        if SELF_VISIBLE:
            seen = seen | ((cols[None, :] == (mlen + p)[:, None]) & (rows < self_rows)[:, None])
        visible = visible & seen
    if CHECK_R:
        visible = visible & (rel < R)
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _dropout_keep(seed, pid_bh, rows, cols, K, dropout_p):
    offsets = rows[:, None] * K + cols[None, :]
    return tl.rand(seed + pid_bh * 1000003, offsets) >= dropout_p


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, kr_ptr, bias_w_ptr, bias_r_ptr, bias_s_ptr, seg_ptr,
    qseg_ptr, kseg_ptr, mask_ptr, qrank_ptr, krank_ptr, qpos_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_krb, stride_krr, stride_krh, stride_bh, stride_seg, stride_segh,
    stride_qsb, stride_qsm, stride_ksb, stride_ksk, stride_mb, stride_mm, stride_mk,
    stride_qrb, stride_qrm, stride_krkb, stride_krk, stride_qpb, stride_qpm,
    stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
    H, M, K, R, D, qlen, mlen, self_rows, qk_scale, seed, dropout_p,
    HAS_SEG: tl.constexpr, MASK_MODE: tl.constexpr, SELF_VISIBLE: tl.constexpr,
    HAS_QPOS: tl.constexpr, CHECK_R: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    row_in = rows < M
    p, row_ok, q_w, q_r, q_s, e0, e1, q_seg, q_rank = _query_side(
        q_ptr, qpos_ptr, qseg_ptr, qrank_ptr, bias_w_ptr, bias_r_ptr, bias_s_ptr, seg_ptr, b, h, rows,
        offs_d, d_ok, M, stride_qb, stride_qm, stride_qh, stride_qpb, stride_qpm, stride_qsb, stride_qsm,
        stride_qrb, stride_qrm, stride_bh, stride_seg, stride_segh, HAS_SEG, MASK_MODE, HAS_QPOS)

    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    kr_base = kr_ptr + b * stride_krb + h * stride_krh
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n0 in range(0, K, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (cols < K)[:, None] & d_ok[None, :]
        k_tile = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q_w, q_r, e0, e1, p, row_ok, q_seg, q_rank, k_tile.to(DOT_DTYPE), n0,
                    kr_base, stride_krr, kseg_ptr + b * stride_ksb, stride_ksk,
                    krank_ptr + b * stride_krkb, stride_krk, mask_ptr + b * stride_mb, stride_mm,
                    stride_mk, rows, offs_d, d_ok, K, R, qlen, mlen, self_rows, qk_scale,
                    HAS_SEG, MASK_MODE, SELF_VISIBLE, CHECK_R, BLOCK_N, DOT_DTYPE, INPUT_PRECISION)
        # online softmax; rows that have seen no visible key yet keep m = -inf and p = 0
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        prob = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        if DROPOUT:
            keep = _dropout_keep(seed, pid_bh, rows, cols, K, dropout_p)
            prob = tl.where(keep, prob / (1.0 - dropout_p), 0.0)
        v_tile = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(prob.to(DOT_DTYPE), v_tile.to(DOT_DTYPE),
                                            input_precision=INPUT_PRECISION)
        m_i = m_new
    has_key = l_i > 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    out_base = out_ptr + b * stride_ob + h * stride_oh
    tl.store(out_base + rows[:, None] * stride_om + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_in[:, None] & d_ok[None, :])
    # natural-log lse of the scaled scores; +inf marks a row with no visible key
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) / 1.4426950408889634,
                   float("inf"))
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + rows, lse, mask=row_in)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _grad_tile(s, lse, delta, do, v_tile, seed, pid_bh, rows, cols, K, dropout_p, scale,
               DROPOUT: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """From a recomputed score tile: the (dropped) probabilities that multiplied V, and dS."""
    prob = tl.exp2(s - lse[:, None] * 1.4426950408889634)  # lse = +inf on empty rows -> 0
    dp = tl.dot(do.to(DOT_DTYPE), tl.trans(v_tile.to(DOT_DTYPE)), input_precision=INPUT_PRECISION)
    if DROPOUT:
        keep = _dropout_keep(seed, pid_bh, rows, cols, K, dropout_p)
        prob_d = tl.where(keep, prob / (1.0 - dropout_p), 0.0)
        dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
    else:
        prob_d = prob
    ds = prob * (dp - delta[:, None]) * scale
    return prob_d, ds


@triton.jit
def _unskew(ds, p, n0, c0, qlen, BLOCK_N: tl.constexpr):
    """Inverse of the shift: dsc[i, c] = dS[i, j] for the j with qlen + j - p_i = c0 + c (0 if none
    in this key tile), a (BLOCK_M, BLOCK_N) tile over k_r rows c0..c0+BLOCK_N."""
    jj = c0 + tl.arange(0, BLOCK_N)[None, :] - qlen + p[:, None] - n0
    inside = (jj >= 0) & (jj < BLOCK_N)
    return tl.where(inside, tl.gather(ds, tl.where(inside, jj, 0), axis=1), 0.0)


@triton.jit
def _bwd_query_side(q_ptr, do_ptr, lse_ptr, delta_ptr, qpos_ptr, qseg_ptr, qrank_ptr,
                    bias_w_ptr, bias_r_ptr, bias_s_ptr, seg_ptr,
                    b, h, rows, offs_d, d_ok, M,
                    stride_qb, stride_qm, stride_qh, stride_dob, stride_dom, stride_doh,
                    stride_lb, stride_lh, stride_qpb, stride_qpm, stride_qsb, stride_qsm,
                    stride_qrb, stride_qrm, stride_bh, stride_seg, stride_segh,
                    HAS_SEG: tl.constexpr, MASK_MODE: tl.constexpr, HAS_QPOS: tl.constexpr):
    """Everything the backward needs on the query side of a tile."""
    row_in = rows < M
    p, row_ok, q_w, q_r, q_s, e0, e1, q_seg, q_rank = _query_side(
        q_ptr, qpos_ptr, qseg_ptr, qrank_ptr, bias_w_ptr, bias_r_ptr, bias_s_ptr, seg_ptr, b, h, rows,
        offs_d, d_ok, M, stride_qb, stride_qm, stride_qh, stride_qpb, stride_qpm, stride_qsb, stride_qsm,
        stride_qrb, stride_qrm, stride_bh, stride_seg, stride_segh, HAS_SEG, MASK_MODE, HAS_QPOS)
    do = tl.load(do_ptr + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom + offs_d[None, :],
                 mask=row_in[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + rows, mask=row_in, other=float("inf"))
    delta = tl.load(delta_ptr + b * stride_lb + h * stride_lh + rows, mask=row_in, other=0.0)
    return p, row_ok, q_w, q_r, q_s, e0, e1, q_seg, q_rank, do, lse, delta


@triton.jit
def _bwd_kv_kernel(
    q_ptr, k_ptr, v_ptr, kr_ptr, bias_w_ptr, bias_r_ptr, bias_s_ptr, seg_ptr,
    qseg_ptr, kseg_ptr, mask_ptr, qrank_ptr, krank_ptr, qpos_ptr,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_krb, stride_krr, stride_krh, stride_bh, stride_seg, stride_segh,
    stride_qsb, stride_qsm, stride_ksb, stride_ksk, stride_mb, stride_mm, stride_mk,
    stride_qrb, stride_qrm, stride_krkb, stride_krk, stride_qpb, stride_qpm,
    H, M, K, R, D, qlen, mlen, self_rows, qk_scale, seed, dropout_p,
    do_ptr, stride_dob, stride_dom, stride_doh, lse_ptr, delta_ptr, stride_lb, stride_lh,
    dk_ptr, dv_ptr, stride_dkb, stride_dkn, stride_dkh, dkr_ptr, stride_dkrb, stride_dkrr, stride_dkrh,
    scale,
    HAS_SEG: tl.constexpr, MASK_MODE: tl.constexpr, SELF_VISIBLE: tl.constexpr,
    HAS_QPOS: tl.constexpr, CHECK_R: tl.constexpr, DROPOUT: tl.constexpr, DKR_ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One key tile: dK and dV over all query tiles; dk_r by fp32 atomics when DKR_ATOMIC."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_mask = (cols < K)[:, None] & d_ok[None, :]
    k_tile = tl.load(k_ptr + b * stride_kb + h * stride_kh + cols[:, None] * stride_kn + offs_d[None, :],
                     mask=kv_mask, other=0.0).to(DOT_DTYPE)
    v_tile = tl.load(v_ptr + b * stride_vb + h * stride_vh + cols[:, None] * stride_vn + offs_d[None, :],
                     mask=kv_mask, other=0.0)
    kr_base = kr_ptr + b * stride_krb + h * stride_krh
    dkr_base = dkr_ptr + b * stride_dkrb + h * stride_dkrh
    n0 = pid_n * BLOCK_N
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        p, row_ok, q_w, q_r, q_s, e0, e1, q_seg, q_rank, do, lse, delta = _bwd_query_side(
            q_ptr, do_ptr, lse_ptr, delta_ptr, qpos_ptr, qseg_ptr, qrank_ptr, bias_w_ptr, bias_r_ptr,
            bias_s_ptr, seg_ptr, b, h, rows, offs_d, d_ok, M, stride_qb, stride_qm, stride_qh,
            stride_dob, stride_dom, stride_doh, stride_lb, stride_lh, stride_qpb, stride_qpm,
            stride_qsb, stride_qsm, stride_qrb, stride_qrm, stride_bh, stride_seg, stride_segh,
            HAS_SEG, MASK_MODE, HAS_QPOS)
        s = _scores(q_w, q_r, e0, e1, p, row_ok, q_seg, q_rank, k_tile, n0,
                    kr_base, stride_krr, kseg_ptr + b * stride_ksb, stride_ksk,
                    krank_ptr + b * stride_krkb, stride_krk, mask_ptr + b * stride_mb, stride_mm,
                    stride_mk, rows, offs_d, d_ok, K, R, qlen, mlen, self_rows, qk_scale,
                    HAS_SEG, MASK_MODE, SELF_VISIBLE, CHECK_R, BLOCK_N, DOT_DTYPE, INPUT_PRECISION)
        prob_d, ds = _grad_tile(s, lse, delta, do, v_tile, seed, pid_bh, rows, cols, K, dropout_p,
                                scale, DROPOUT, DOT_DTYPE, INPUT_PRECISION)
        dv += tl.dot(tl.trans(prob_d).to(DOT_DTYPE), do.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
        dk += tl.dot(tl.trans(ds).to(DOT_DTYPE), q_w.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
        if DKR_ATOMIC:
            # dk_r[c] += sum over (i, j) with qlen + j - p_i = c of dS[i, j] (q_i + r_r_bias)
            c_lo, c_hi = _window(p, row_ok, n0, qlen, R, BLOCK_N)
            for c0 in range(c_lo, c_hi, BLOCK_N):
                dsc = _unskew(ds, p, n0, c0, qlen, BLOCK_N)
                part = tl.dot(tl.trans(dsc).to(DOT_DTYPE), q_r.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
                c_rows = c0 + tl.arange(0, BLOCK_N)
                tl.atomic_add(dkr_base + c_rows[:, None] * stride_dkrr + offs_d[None, :], part,
                              mask=(c_rows < R)[:, None] & d_ok[None, :], sem="relaxed")
    out_off = b * stride_dkb + h * stride_dkh + cols[:, None] * stride_dkn + offs_d[None, :]
    tl.store(dk_ptr + out_off, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out_off, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_q_kernel(
    q_ptr, k_ptr, v_ptr, kr_ptr, bias_w_ptr, bias_r_ptr, bias_s_ptr, seg_ptr,
    qseg_ptr, kseg_ptr, mask_ptr, qrank_ptr, krank_ptr, qpos_ptr,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_krb, stride_krr, stride_krh, stride_bh, stride_seg, stride_segh,
    stride_qsb, stride_qsm, stride_ksb, stride_ksk, stride_mb, stride_mm, stride_mk,
    stride_qrb, stride_qrm, stride_krkb, stride_krk, stride_qpb, stride_qpm,
    H, M, K, R, D, qlen, mlen, self_rows, qk_scale, seed, dropout_p,
    do_ptr, stride_dob, stride_dom, stride_doh, lse_ptr, delta_ptr, stride_lb, stride_lh,
    dq_ptr, stride_dqb, stride_dqm, stride_dqh, part_ptr, n_m_tiles,
    scale,
    HAS_SEG: tl.constexpr, MASK_MODE: tl.constexpr, SELF_VISIBLE: tl.constexpr,
    HAS_QPOS: tl.constexpr, CHECK_R: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """One query tile: dQ over all key tiles, plus this tile's sums for the bias and seg_embed
    gradients in ``part (B*H, n_m_tiles, 6, BLOCK_D)``: sum dq_w, sum dq_r, sum g0 q_s, sum g1 q_s,
    and sum g0, sum g1 (in column 0) where g_s = row sums of dS over keys of segment relation s."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    p, row_ok, q_w, q_r, q_s, e0, e1, q_seg, q_rank, do, lse, delta = _bwd_query_side(
        q_ptr, do_ptr, lse_ptr, delta_ptr, qpos_ptr, qseg_ptr, qrank_ptr, bias_w_ptr, bias_r_ptr,
        bias_s_ptr, seg_ptr, b, h, rows, offs_d, d_ok, M, stride_qb, stride_qm, stride_qh,
        stride_dob, stride_dom, stride_doh, stride_lb, stride_lh, stride_qpb, stride_qpm,
        stride_qsb, stride_qsm, stride_qrb, stride_qrm, stride_bh, stride_seg, stride_segh,
        HAS_SEG, MASK_MODE, HAS_QPOS)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    kr_base = kr_ptr + b * stride_krb + h * stride_krh
    dq_w = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    dq_r = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    g_all = tl.sum(dq_w, axis=1)
    g_diff = g_all
    for n0 in range(0, K, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (cols < K)[:, None] & d_ok[None, :]
        k_tile = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v_tile = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q_w, q_r, e0, e1, p, row_ok, q_seg, q_rank, k_tile, n0,
                    kr_base, stride_krr, kseg_ptr + b * stride_ksb, stride_ksk,
                    krank_ptr + b * stride_krkb, stride_krk, mask_ptr + b * stride_mb, stride_mm,
                    stride_mk, rows, offs_d, d_ok, K, R, qlen, mlen, self_rows, qk_scale,
                    HAS_SEG, MASK_MODE, SELF_VISIBLE, CHECK_R, BLOCK_N, DOT_DTYPE, INPUT_PRECISION)
        prob_d, ds = _grad_tile(s, lse, delta, do, v_tile, seed, pid_bh, rows, cols, K, dropout_p,
                                scale, DROPOUT, DOT_DTYPE, INPUT_PRECISION)
        dq_w += tl.dot(ds.to(DOT_DTYPE), k_tile, input_precision=INPUT_PRECISION)
        c_lo, c_hi = _window(p, row_ok, n0, qlen, R, BLOCK_N)
        for c0 in range(c_lo, c_hi, BLOCK_N):
            c_rows = c0 + tl.arange(0, BLOCK_N)
            kr = tl.load(kr_base + c_rows[:, None] * stride_krr + offs_d[None, :],
                         mask=(c_rows < R)[:, None] & d_ok[None, :], other=0.0)
            dsc = _unskew(ds, p, n0, c0, qlen, BLOCK_N)
            dq_r += tl.dot(dsc.to(DOT_DTYPE), kr.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
        if HAS_SEG:
            k_seg = tl.load(kseg_ptr + b * stride_ksb + cols * stride_ksk, mask=cols < K, other=0)
            g_all += tl.sum(ds, axis=1)
            g_diff += tl.sum(tl.where(q_seg[:, None] != k_seg[None, :], ds, 0.0), axis=1)
    dq = dq_w + dq_r
    part_base = part_ptr + (pid_bh * n_m_tiles + pid_m) * 6 * BLOCK_D + offs_d
    tl.store(part_base, tl.sum(dq_w, axis=0))
    tl.store(part_base + BLOCK_D, tl.sum(dq_r, axis=0))
    if HAS_SEG:
        g_same = g_all - g_diff
        seg0 = tl.load(seg_ptr + h * stride_segh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        seg1 = tl.load(seg_ptr + h * stride_segh + stride_seg + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        dq += g_same[:, None] * seg0[None, :] + g_diff[:, None] * seg1[None, :]
        tl.store(part_base + 2 * BLOCK_D, tl.sum(g_same[:, None] * q_s, axis=0))
        tl.store(part_base + 3 * BLOCK_D, tl.sum(g_diff[:, None] * q_s, axis=0))
        first = offs_d == 0
        tl.store(part_base + 4 * BLOCK_D, tl.where(first, tl.sum(g_same, axis=0), 0.0))
        tl.store(part_base + 5 * BLOCK_D, tl.where(first, tl.sum(g_diff, axis=0), 0.0))
    tl.store(dq_ptr + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqm + offs_d[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=(rows < M)[:, None] & d_ok[None, :])


@triton.jit
def _bwd_kr_kernel(
    q_ptr, k_ptr, v_ptr, kr_ptr, bias_w_ptr, bias_r_ptr, bias_s_ptr, seg_ptr,
    qseg_ptr, kseg_ptr, mask_ptr, qrank_ptr, krank_ptr, qpos_ptr,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_krb, stride_krr, stride_krh, stride_bh, stride_seg, stride_segh,
    stride_qsb, stride_qsm, stride_ksb, stride_ksk, stride_mb, stride_mm, stride_mk,
    stride_qrb, stride_qrm, stride_krkb, stride_krk, stride_qpb, stride_qpm,
    H, M, K, R, D, qlen, mlen, self_rows, qk_scale, seed, dropout_p,
    do_ptr, stride_dob, stride_dom, stride_doh, lse_ptr, delta_ptr, stride_lb, stride_lh,
    dkr_ptr, stride_dkrb, stride_dkrr, stride_dkrh, n_batch_per_kr,
    scale,
    HAS_SEG: tl.constexpr, MASK_MODE: tl.constexpr, SELF_VISIBLE: tl.constexpr,
    HAS_QPOS: tl.constexpr, CHECK_R: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """Deterministic dk_r: one tile of k_r rows owns its gradient and recomputes every score tile
    that reads it (over the batch rows sharing this k_r, and all query tiles)."""
    pid_c = tl.program_id(0)
    pid_brh = tl.program_id(1)
    br = pid_brh // H
    h = pid_brh % H
    c0 = pid_c * BLOCK_N
    c_rows = c0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for bi in range(0, n_batch_per_kr):
        b = br * n_batch_per_kr + bi
        pid_bh = b * H + h
        kr_base = kr_ptr + b * stride_krb + h * stride_krh
        for m0 in range(0, M, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            p, row_ok, q_w, q_r, q_s, e0, e1, q_seg, q_rank, do, lse, delta = _bwd_query_side(
                q_ptr, do_ptr, lse_ptr, delta_ptr, qpos_ptr, qseg_ptr, qrank_ptr, bias_w_ptr,
                bias_r_ptr, bias_s_ptr, seg_ptr, b, h, rows, offs_d, d_ok, M, stride_qb, stride_qm,
                stride_qh, stride_dob, stride_dom, stride_doh, stride_lb, stride_lh, stride_qpb,
                stride_qpm, stride_qsb, stride_qsm, stride_qrb, stride_qrm, stride_bh, stride_seg,
                stride_segh, HAS_SEG, MASK_MODE, HAS_QPOS)
            # keys j whose k_r row qlen + j - p_i falls in [c0, c0 + BLOCK_N)
            p_hi = tl.max(tl.where(row_ok, p, -1), axis=0)
            p_lo = tl.min(tl.where(row_ok, p, qlen), axis=0)
            j_lo = tl.maximum(c0 - qlen + p_lo, 0)
            j_hi = tl.minimum(c0 + BLOCK_N - qlen + p_hi, K)
            for n0 in range((j_lo // BLOCK_N) * BLOCK_N, j_hi, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                kv_mask = (cols < K)[:, None] & d_ok[None, :]
                k_tile = tl.load(k_ptr + b * stride_kb + h * stride_kh + cols[:, None] * stride_kn
                                 + offs_d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
                v_tile = tl.load(v_ptr + b * stride_vb + h * stride_vh + cols[:, None] * stride_vn
                                 + offs_d[None, :], mask=kv_mask, other=0.0)
                s = _scores(q_w, q_r, e0, e1, p, row_ok, q_seg, q_rank, k_tile, n0,
                            kr_base, stride_krr, kseg_ptr + b * stride_ksb, stride_ksk,
                            krank_ptr + b * stride_krkb, stride_krk, mask_ptr + b * stride_mb,
                            stride_mm, stride_mk, rows, offs_d, d_ok, K, R, qlen, mlen, self_rows, qk_scale,
                            HAS_SEG, MASK_MODE, SELF_VISIBLE, CHECK_R, BLOCK_N, DOT_DTYPE,
                            INPUT_PRECISION)
                prob_d, ds = _grad_tile(s, lse, delta, do, v_tile, seed, pid_bh, rows, cols, K,
                                        dropout_p, scale, DROPOUT, DOT_DTYPE, INPUT_PRECISION)
                dsc = _unskew(ds, p, n0, c0, qlen, BLOCK_N)
                acc += tl.dot(tl.trans(dsc).to(DOT_DTYPE), q_r.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
    tl.store(dkr_ptr + br * stride_dkrb + h * stride_dkrh + c_rows[:, None] * stride_dkrr + offs_d[None, :],
             acc, mask=(c_rows < R)[:, None] & d_ok[None, :])


def _configs():
    shapes = [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2), (128, 32, 4, 3),
              (64, 32, 4, 2), (32, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 2)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in shapes]


_TUNE_KEY = ["M", "K", "D", "HAS_QPOS", "MASK_MODE", "HAS_SEG", "DROPOUT", "DOT_DTYPE"]
fwd_kernel_tuned = triton.autotune(_configs(), key=_TUNE_KEY)(_fwd_kernel)
bwd_kv_kernel_tuned = triton.autotune(_configs(), key=_TUNE_KEY + ["DKR_ATOMIC"],
                                      reset_to_zero=["dkr_ptr"])(_bwd_kv_kernel)
bwd_q_kernel_tuned = triton.autotune(_configs(), key=_TUNE_KEY, reset_to_zero=["part_ptr"])(_bwd_q_kernel)
