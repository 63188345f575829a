"""The attention kernels' per-row operands, and the backward's last two passes, each one launch.

The attention kernels (``rel_attention.py``) read the query side and, in the backward, dO in their
own row order (``ROWS``: sorted by position) and head-major layout, pre-biased and pre-scaled. The
first two kernels here write those operands, one pass over the rows each: the forward's over q,
the backward's over q, dO and O (its query operands again: the forward does not keep them); in
PyTorch the same took a dozen passes through fp32 intermediates (the first GPU run measured 0.8 ms
of such work per forward at qlen 512, B=32: bench/NOTES.md). The last two turn the backward's partial sums into the
gradients of k_r, the biases and seg_embed: the first per batch row and head, the second adding the
batch rows per head (in PyTorch: some thirty small kernels).

Rows come from up to two sources: the caller's rows ``[0, L)`` from Q (DOUT) and ``[L, M)`` from
Q_G (DOUT_G), the query stream of a two-stream call, so that neither is concatenated. The bias
parameters may come in float32 under ``torch.autocast`` while q is bf16/fp16: they are taken in q's
dtype (rounded to it, as a cast would), which is what the op computes with (docs/DESIGN.md §4).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .rel_attention import E_DELTA, E_FIELDS, E_SAME, INT32_MIN, LOG2E, ROW_FIELDS, ROW_RANK, ROW_SRC

# Rows per program: a (ROWS_PER_PROGRAM, BLOCK_D) tile, enough to keep a few loads in flight.
ROWS_PER_PROGRAM = 32
# The finishing kernel: elements of dk_r per converting program, and per step of a (batch row,
# head)'s sums (rows of BLOCK_D: 32 at D=64, 16 at D=128; 64 rows spilled 12 B at sm_120 without
# segments, when one program summed a head's every batch row, and 32 at sm_90 with segments once the
# ROWS table had a fifth field).
FINISH_BLOCK = 1024
FINISH_STEP = 2048
# Query rows of one (batch row, head) per finishing program, at least a step's (and that batch row's
# and head's share of the per-tile sums): with one program per (batch row, head), 16 programs
# walked 8192 rows each at 1x16 8192 (H200: 0.47 ms, 5% of the fwd+bwd; 0.93 ms at 16384).
FINISH_CHUNK_ROWS = 128
# The rows of a (batch row, head, chunk)'s partial sums that the finishing kernel writes and the
# heads' kernel adds over batch rows and chunks (SUMS); those per step of that sum.
SUM_PARTK, SUM_PART, SUM_GQ, SUM_G = (tl.constexpr(i) for i in range(4))
FINISH_PARTS = tl.constexpr(4)
HEADS_B_STEP = 32


def grad_rows_per_program(block_d: int) -> int:
    """Rows per program of ``_grad_operands_kernel``, which holds q's, dO's and O's tiles: half of
    ROWS_PER_PROGRAM past BLOCK_D = 64 (sm_120 spilled 16 B at D=128 with 32 rows, triton 3.6)."""
    return ROWS_PER_PROGRAM if block_d <= 64 else ROWS_PER_PROGRAM // 2


@triton.jit
def _rows_of_program(ROWS, pid_m, b, M, BLOCK_M: tl.constexpr):
    """This program's rows of batch row ``b`` (int64): their index in the kernels' order, in-range
    mask, caller's row, and whether each is a real row (padding rows have rank INT32_MIN)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < M
    meta = ROWS + (b * M + rows) * ROW_FIELDS
    src = tl.load(meta + ROW_SRC, mask=row_in, other=0)
    real = tl.load(meta + ROW_RANK, mask=row_in, other=INT32_MIN) != INT32_MIN
    return rows, row_in, src, real


@triton.jit
def _load_caller_rows(X, X_G, b, src, h, d, L, row_mask, stride_xb, stride_xm, stride_xh, stride_xd,
                      stride_gb, stride_gm, stride_gh, stride_gd):
    """(rows, BLOCK_D) fp32: caller's row ``src`` of head ``h`` of batch row ``b`` (int64), from X (rows
    < L) or X_G (the rest)."""
    in_x = src < L
    x = tl.load(X + b * stride_xb + src[:, None] * stride_xm + h * stride_xh + d[None, :] * stride_xd,
                mask=row_mask & in_x[:, None], other=0.0)
    x_g = tl.load(X_G + b * stride_gb + (src - L)[:, None] * stride_gm + h * stride_gh + d[None, :] * stride_gd,
                  mask=row_mask & ~in_x[:, None], other=0.0)
    return x.to(tl.float32) + x_g.to(tl.float32)


@triton.jit
def _as_dtype_of(x, LIKE):
    """x (loaded from a bias parameter) rounded to the element type of pointer LIKE, as fp32, the way
    torch casts: to bf16 by rounding the bits to nearest even (triton's CPU interpreter truncates a
    cast to bf16; a GPU rounds like this), to the other types by a cast."""
    x = x.to(tl.float32)
    if LIKE.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.where(x == x, rounded, x)  # NaN stays NaN
    else:
        return x.to(LIKE.dtype.element_ty).to(tl.float32)


@triton.jit
def _write_query_operands(Q, Q_G, RW, RR, RS, SEG, QW, QR, E, b, h, pid_bh, rows, row_in, src, real, d, d_in,
                          M, L, H, qk_scale, stride_qb, stride_qm, stride_qh, stride_qd,
                          stride_gb, stride_gm, stride_gh, stride_gd,
                          SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """One program's rows of QW, QR and E (``_query_operands_kernel``); returns their E_SAME field,
    (BLOCK_M,) fp32."""
    q = _load_caller_rows(Q, Q_G, b, src, h, d, L, real[:, None] & d_in[None, :], stride_qb, stride_qm, stride_qh,
                          stride_qd, stride_gb, stride_gm, stride_gh, stride_gd)
    head = h * HEAD_DIM + d
    out_rows = pid_bh.to(tl.int64) * M + rows
    out_ptrs = (out_rows * HEAD_DIM)[:, None] + d[None, :]
    out_mask = row_in[:, None] & d_in[None, :]
    r_w = _as_dtype_of(tl.load(RW + head, mask=d_in, other=0.0), Q)
    tl.store(QW + out_ptrs, ((q + r_w[None, :]) * qk_scale).to(QW.dtype.element_ty), mask=out_mask)
    r_r = _as_dtype_of(tl.load(RR + head, mask=d_in, other=0.0), Q)
    tl.store(QR + out_ptrs, ((q + r_r[None, :]) * qk_scale).to(QR.dtype.element_ty), mask=out_mask)
    e_same = tl.zeros((BLOCK_M,), dtype=tl.float32)
    e_delta = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if SEGMENTS:
        r_s = _as_dtype_of(tl.load(RS + head, mask=d_in, other=0.0), Q)
        seg_same = _as_dtype_of(tl.load(SEG + head, mask=d_in, other=0.0), Q)
        seg_other = _as_dtype_of(tl.load(SEG + H * HEAD_DIM + head, mask=d_in, other=0.0), Q)
        q_s = (q + r_s[None, :]) * qk_scale
        e_same = tl.sum(q_s * seg_same[None, :], axis=1)
        e_delta = tl.sum(q_s * (seg_other - seg_same)[None, :], axis=1)
    tl.store(E + out_rows * E_FIELDS + E_SAME, e_same, mask=row_in)
    tl.store(E + out_rows * E_FIELDS + E_DELTA, e_delta, mask=row_in)
    return e_same


@triton.jit
def _query_operands_kernel(
    Q, Q_G, ROWS, RW, RR, RS, SEG, QW, QR, E,
    stride_qb, stride_qm, stride_qh, stride_qd, stride_gb, stride_gm, stride_gh, stride_gd,
    M, L, H, qk_scale,
    SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """QW, QR (B, H, M, HEAD_DIM) in the dot dtype and E (B, H, M, E_FIELDS) fp32, rows in ROWS
    order: ``(q + r_w_bias) * qk_scale``, the same with ``r_r_bias``, and the segment scores
    ``(q + r_s_bias) * qk_scale`` dotted with ``seg_embed[0]`` and ``seg_embed[1] - seg_embed[0]``
    (zeros without SEGMENTS); a padding row's q counts as zero.

    Q (B, L, H, HEAD_DIM) and Q_G (B, M - L, H, HEAD_DIM), any strides, the caller's rows; RW, RR,
    RS (H, HEAD_DIM) and SEG (2, H, HEAD_DIM) contiguous. Grid (cdiv(M, BLOCK_M), B * H)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = (pid_bh // H).to(tl.int64), pid_bh % H
    rows, row_in, src, real = _rows_of_program(ROWS, pid_m, b, M, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    _write_query_operands(Q, Q_G, RW, RR, RS, SEG, QW, QR, E, b, h, pid_bh, rows, row_in, src, real, d,
                          d < HEAD_DIM, M, L, H, qk_scale, stride_qb, stride_qm, stride_qh, stride_qd,
                          stride_gb, stride_gm, stride_gh, stride_gd, SEGMENTS, HEAD_DIM, BLOCK_M)


@triton.jit
def _clear_share(X, n, program, n_programs, BLOCK: tl.constexpr):
    """Program ``program`` of ``n_programs`` zeroes its share of X[0:n] (fp32), BLOCK at a time."""
    per_program = tl.cdiv(tl.cdiv(n, BLOCK), n_programs).to(tl.int64) * BLOCK
    start = program.to(tl.int64) * per_program
    end = tl.minimum(start + per_program, n)
    offs = tl.arange(0, BLOCK)
    for at in range(start, end, BLOCK):
        tl.store(X + at + offs, tl.zeros((BLOCK,), tl.float32), mask=at + offs < end)


@triton.jit
def _grad_operands_kernel(
    Q, Q_G, RW, RR, RS, DOUT, DOUT_G, OUT, LSE, ROWS, SEG, QW, QR, E, DO, LSE2, DELTA, SEGD, DKR_SUMS,
    stride_qb, stride_qm, stride_qh, stride_qd, stride_qgb, stride_qgm, stride_qgh, stride_qgd,
    stride_gb, stride_gm, stride_gh, stride_gd, stride_hb, stride_hm, stride_hh, stride_hd,
    stride_ob, stride_om, stride_oh, stride_od,
    M, L, H, qk_scale, keep_scale, n_clear,
    SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The backward's row operands in ROWS order, in the pass that writes its query operands QW, QR
    and E as ``_query_operands_kernel`` does (Q, Q_G, RW, RR, RS, SEG and their strides as there:
    one launch for both, the backward's first): DO (B, H, M, HEAD_DIM) in the dot dtype, dO times
    the dropout keep scale; DELTA (B, H, M) fp32, rowsum(dO * O); LSE2 (B, H, M) fp32, the forward's
    log-sum-exp in base 2 less the same-segment score E[..., E_SAME] that the recomputed scores
    leave out. With SEGMENTS, the first program of each head also writes SEGD (H, HEAD_DIM) fp32,
    ``seg_embed[1] - seg_embed[0]`` in the dot operands' dtype (the dQ kernel's segment term). And
    the programs clear the first ``n_clear`` fp32 of DKR_SUMS, the dk_r sums that the dQ kernel
    accumulates into by atomics (a launch of its own saved).

    DOUT (B, L, H, HEAD_DIM) and DOUT_G (B, M - L, H, HEAD_DIM), OUT (B, M, H, HEAD_DIM), any
    strides, and LSE (B, H, M) contiguous, in the caller's rows. Grid (cdiv(M, BLOCK_M), B * H)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    _clear_share(DKR_SUMS, n_clear, pid_bh * tl.num_programs(0) + pid_m, tl.num_programs(0) * tl.num_programs(1),
                 BLOCK_M * BLOCK_D)
    b, h = (pid_bh // H).to(tl.int64), pid_bh % H
    rows, row_in, src, real = _rows_of_program(ROWS, pid_m, b, M, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_in = d < HEAD_DIM
    e_same = _write_query_operands(Q, Q_G, RW, RR, RS, SEG, QW, QR, E, b, h, pid_bh, rows, row_in, src, real, d, d_in,
                                   M, L, H, qk_scale, stride_qb, stride_qm, stride_qh, stride_qd,
                                   stride_qgb, stride_qgm, stride_qgh, stride_qgd, SEGMENTS, HEAD_DIM, BLOCK_M)
    in_mask = row_in[:, None] & d_in[None, :]
    dout = _load_caller_rows(DOUT, DOUT_G, b, src, h, d, L, in_mask, stride_gb, stride_gm, stride_gh, stride_gd,
                             stride_hb, stride_hm, stride_hh, stride_hd)
    out = tl.load(OUT + b * stride_ob + src[:, None] * stride_om + h * stride_oh + d[None, :] * stride_od,
                  mask=in_mask, other=0.0).to(tl.float32)
    out_rows = pid_bh.to(tl.int64) * M + rows
    tl.store(DELTA + out_rows, tl.sum(dout * out, axis=1), mask=row_in)
    tl.store(DO + (out_rows * HEAD_DIM)[:, None] + d[None, :], (dout * keep_scale).to(DO.dtype.element_ty),
             mask=in_mask)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * M + src, mask=row_in, other=0.0)
    tl.store(LSE2 + out_rows, lse * LOG2E - e_same, mask=row_in)
    if SEGMENTS:
        if (pid_m == 0) & (b == 0):
            head = h * HEAD_DIM + d
            seg_same = _as_dtype_of(tl.load(SEG + head, mask=d_in, other=0.0), DOUT)
            seg_other = _as_dtype_of(tl.load(SEG + H * HEAD_DIM + head, mask=d_in, other=0.0), DOUT)
            tl.store(SEGD + head, seg_other - seg_same, mask=d_in)


@triton.jit
def _tile_sums(PARTS, bh, n_tiles, n_used, chunk, n_chunks, d, BLOCK_D: tl.constexpr, ROWS_STEP: tl.constexpr):
    """(BLOCK_D,) fp32: the sum of share ``chunk`` of ``n_chunks`` of the first ``n_used`` tiles of row
    ``bh`` of PARTS (B*H, n_tiles, BLOCK_D)."""
    per_chunk = tl.cdiv(n_used, n_chunks)
    t_end = tl.minimum(n_used, (chunk + 1) * per_chunk)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    base = PARTS + tl.cast(bh, tl.int64) * n_tiles * BLOCK_D
    for t0 in range(chunk * per_chunk, t_end, ROWS_STEP):
        t = t0 + tl.arange(0, ROWS_STEP)
        acc += tl.sum(tl.load(base + t[:, None] * BLOCK_D + d[None, :], mask=(t < t_end)[:, None], other=0.0),
                      axis=0)
    return acc


@triton.jit
def _grad_finish_kernel(
    DKR_SUMS, DKR, PART, PARTK, G, ROWS, Q, Q_G, SUMS,
    stride_qb, stride_qm, stride_qh, stride_qd, stride_gb, stride_gm, stride_gh, stride_gd,
    n_dkr, dkr_rows, R, M, L, H, n_m_tiles, n_n_tiles, n_m_used, n_n_used, n_convert, n_chunks,
    SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    ROWS_STEP: tl.constexpr, CHUNK_ROWS: tl.constexpr,
):
    """The backward's last pass but one. Programs [0, n_convert) write dk_r: DKR (Br, R, H, HEAD_DIM)
    in k_r's dtype, the kernels' fp32 sums DKR_SUMS (Br, dkr_rows, H, HEAD_DIM) over log2 e (the
    kernels differentiate base-2 scores); ``n_dkr`` = Br * R * H * HEAD_DIM elements. Program
    n_convert + (b * H + h) * n_chunks + c writes the share of chunk c (CHUNK_ROWS rows, and a
    ``n_chunks``-th of the tiles) of batch row b in head h's bias and segment sums to SUMS
    (B*H*n_chunks, FINISH_PARTS, BLOCK_D) fp32, which ``_grad_heads_kernel`` adds over batch rows
    and chunks (one program per head summing every batch row took 0.55 ms at B=32, H=16, 512/384 on
    an H100):
    SUM_PARTK: the dK/dV kernel's PARTK (B*H, n_n_tiles, BLOCK_D) summed over its first n_n_used
    tiles, the column sums of r_w_bias's gradient; SUM_PART: the dQ kernel's PART (B*H, n_m_tiles,
    BLOCK_D), n_m_used filled, those of dq before the segment term (both biases); with SEGMENTS, from
    G (B, H, M), each row's dS over keys of another segment (rows in ROWS order): SUM_GQ = sum over
    real rows of G * q (q read from Q/Q_G at the caller's rows) and SUM_G = [sum of G, sum of G over
    real rows, 0, ...]. Grid (n_convert + B * H * n_chunks,)."""
    pid = tl.program_id(0)
    if pid < n_convert:
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inner = H * HEAD_DIM
        row = offs // inner  # br * R + r
        sums_at = (row // R) * dkr_rows * inner + (row % R) * inner + offs % inner
        x = tl.load(DKR_SUMS + sums_at, mask=offs < n_dkr, other=0.0)
        tl.store(DKR + offs, (x / LOG2E).to(DKR.dtype.element_ty), mask=offs < n_dkr)
    else:
        share = pid - n_convert
        bh = share // n_chunks
        chunk = share % n_chunks
        b = tl.cast(bh // H, tl.int64)
        h = bh % H
        d = tl.arange(0, BLOCK_D)
        d_in = d < HEAD_DIM
        out = SUMS + tl.cast(share, tl.int64) * FINISH_PARTS * BLOCK_D + d
        tl.store(out + SUM_PARTK * BLOCK_D,
                 _tile_sums(PARTK, bh, n_n_tiles, n_n_used, chunk, n_chunks, d, BLOCK_D, ROWS_STEP))
        tl.store(out + SUM_PART * BLOCK_D,
                 _tile_sums(PART, bh, n_m_tiles, n_m_used, chunk, n_chunks, d, BLOCK_D, ROWS_STEP))
        if SEGMENTS:
            g_all = tl.zeros((ROWS_STEP,), tl.float32)
            g_real = tl.zeros((ROWS_STEP,), tl.float32)
            g_q = tl.zeros((BLOCK_D,), tl.float32)
            for m0 in range(chunk * CHUNK_ROWS, tl.minimum(M, (chunk + 1) * CHUNK_ROWS), ROWS_STEP):
                rows, row_in, src, real = _rows_of_program(ROWS, m0 // ROWS_STEP, b, M, ROWS_STEP)
                g = tl.load(G + (b * H + h) * M + rows, mask=row_in, other=0.0)
                g_all += g
                g_real += tl.where(real, g, 0.0)
                q = _load_caller_rows(Q, Q_G, b, src, h, d, L, real[:, None] & d_in[None, :], stride_qb,
                                      stride_qm, stride_qh, stride_qd, stride_gb, stride_gm, stride_gh, stride_gd)
                g_q += tl.sum(g[:, None] * q, axis=0)
            tl.store(out + SUM_GQ * BLOCK_D, g_q)
            g_sums = tl.where(d == 0, tl.sum(g_all, axis=0), tl.where(d == 1, tl.sum(g_real, axis=0), 0.0))
            tl.store(out + SUM_G * BLOCK_D, g_sums)


@triton.jit
def _batch_sums(SUMS, h, H, B, n_chunks, part, d, BLOCK_D: tl.constexpr, B_STEP: tl.constexpr):
    """(BLOCK_D,) fp32: row ``part`` of SUMS (B*H*n_chunks, FINISH_PARTS, BLOCK_D) summed over the
    batch rows and chunks of head h, in a fixed order."""
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for i0 in range(0, B * n_chunks, B_STEP):
        i = i0 + tl.arange(0, B_STEP)  # batch row i // n_chunks, chunk i % n_chunks
        share = (tl.cast(i // n_chunks, tl.int64) * H + h) * n_chunks + i % n_chunks
        at = (share * FINISH_PARTS + part)[:, None] * BLOCK_D + d[None, :]
        acc += tl.sum(tl.load(SUMS + at, mask=(i < B * n_chunks)[:, None], other=0.0), axis=0)
    return acc


@triton.jit
def _grad_heads_kernel(
    SUMS, Q, RS, SEGD, DRW, DRR, DRS, DSEG, B, H, n_chunks, scale,
    SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, B_STEP: tl.constexpr,
):
    """The backward's last pass: program h adds ``_grad_finish_kernel``'s SUMS over batch rows and
    their chunks and writes head h of the bias and segment gradients, each in its parameter's dtype
    (docs/DESIGN.md §3): DRW = scale * SUM_PARTK, DRR = scale * SUM_PART - DRW, and with SEGMENTS
    (over its own segment's keys a row's dS sums to -G) DRS = scale * sum(G) * SEGD (H, HEAD_DIM) and
    DSEG (2, H, HEAD_DIM) = -/+ scale * (SUM_GQ + sum of G over real rows * r_s_bias), r_s_bias read
    from RS in q's dtype (Q: only its dtype is read). Grid (H,)."""
    h = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_in = d < HEAD_DIM
    head = h * HEAD_DIM + d
    dr_w = _batch_sums(SUMS, h, H, B, n_chunks, SUM_PARTK, d, BLOCK_D, B_STEP) * scale
    dr_r = _batch_sums(SUMS, h, H, B, n_chunks, SUM_PART, d, BLOCK_D, B_STEP) * scale - dr_w
    tl.store(DRW + head, dr_w.to(DRW.dtype.element_ty), mask=d_in)
    tl.store(DRR + head, dr_r.to(DRR.dtype.element_ty), mask=d_in)
    dr_s = tl.zeros((BLOCK_D,), tl.float32)
    dseg = tl.zeros((BLOCK_D,), tl.float32)
    if SEGMENTS:
        g_sums = _batch_sums(SUMS, h, H, B, n_chunks, SUM_G, d, BLOCK_D, B_STEP)
        g_all = tl.sum(tl.where(d == 0, g_sums, 0.0), axis=0)
        g_real = tl.sum(tl.where(d == 1, g_sums, 0.0), axis=0)
        r_s = _as_dtype_of(tl.load(RS + head, mask=d_in, other=0.0), Q)
        dr_s = scale * g_all * tl.load(SEGD + head, mask=d_in, other=0.0)
        dseg = scale * (_batch_sums(SUMS, h, H, B, n_chunks, SUM_GQ, d, BLOCK_D, B_STEP) + g_real * r_s)
    tl.store(DRS + head, dr_s.to(DRS.dtype.element_ty), mask=d_in)
    tl.store(DSEG + head, (-dseg).to(DSEG.dtype.element_ty), mask=d_in)
    tl.store(DSEG + H * HEAD_DIM + head, dseg.to(DSEG.dtype.element_ty), mask=d_in)


KERNELS = (_query_operands_kernel, _grad_operands_kernel, _grad_finish_kernel, _grad_heads_kernel)
