"""The attention kernels' per-row operands, each built in one pass over its (B, M, H, D) input.

The attention kernels (``rel_attention.py``) read the query side and, in the backward, dO in their
own row order (``ROWS``: sorted by position) and head-major layout, pre-biased and pre-scaled. These
two kernels write those operands; in PyTorch the same took a dozen passes through fp32
intermediates (the first GPU run measured 0.8 ms of such work per forward at qlen 512, B=32:
bench/NOTES.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .rel_attention import E_DELTA, E_FIELDS, E_SAME, INT32_MIN, LOG2E, ROW_FIELDS, ROW_RANK, ROW_SRC

# Rows per program: a (ROWS_PER_PROGRAM, BLOCK_D) tile, enough to keep a few loads in flight.
ROWS_PER_PROGRAM = 32


@triton.jit
def _rows_of_program(ROWS, pid_m, b, M, BLOCK_M: tl.constexpr):
    """This program's rows: their index in the kernels' order, in-range mask, caller's row, and
    whether each is a real row (padding rows have rank INT32_MIN)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < M
    meta = ROWS + (b.to(tl.int64) * M + rows) * ROW_FIELDS
    src = tl.load(meta + ROW_SRC, mask=row_in, other=0)
    real = tl.load(meta + ROW_RANK, mask=row_in, other=INT32_MIN) != INT32_MIN
    return rows, row_in, src, real


@triton.jit
def _query_operands_kernel(
    Q, ROWS, RW, RR, RS, SEG, QW, QR, E,
    stride_qb, stride_qm, stride_qh, stride_qd,
    M, H, qk_scale,
    SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """QW, QR (B, H, M, HEAD_DIM) in the dot dtype and E (B, H, M, E_FIELDS) fp32, rows in ROWS
    order: ``(q + r_w_bias) * qk_scale``, the same with ``r_r_bias``, and the segment scores
    ``(q + r_s_bias) * qk_scale`` dotted with ``seg_embed[0]`` and ``seg_embed[1] - seg_embed[0]``
    (zeros without SEGMENTS); a padding row's q counts as zero.

    Q (B, M, H, HEAD_DIM) in the caller's rows; RW, RR, RS (H, HEAD_DIM) and SEG (2, H, HEAD_DIM)
    contiguous. Grid (cdiv(M, BLOCK_M), B * H)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows, row_in, src, real = _rows_of_program(ROWS, pid_m, b, M, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_in = d < HEAD_DIM
    q_ptrs = Q + b.to(tl.int64) * stride_qb + src[:, None] * stride_qm + h * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=real[:, None] & d_in[None, :], other=0.0).to(tl.float32)
    head = h * HEAD_DIM + d
    out_rows = pid_bh.to(tl.int64) * M + rows
    out_ptrs = (out_rows * HEAD_DIM)[:, None] + d[None, :]
    out_mask = row_in[:, None] & d_in[None, :]
    r_w = tl.load(RW + head, mask=d_in, other=0.0).to(tl.float32)
    tl.store(QW + out_ptrs, ((q + r_w[None, :]) * qk_scale).to(QW.dtype.element_ty), mask=out_mask)
    r_r = tl.load(RR + head, mask=d_in, other=0.0).to(tl.float32)
    tl.store(QR + out_ptrs, ((q + r_r[None, :]) * qk_scale).to(QR.dtype.element_ty), mask=out_mask)
    e_same = tl.zeros((BLOCK_M,), dtype=tl.float32)
    e_delta = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if SEGMENTS:
        r_s = tl.load(RS + head, mask=d_in, other=0.0).to(tl.float32)
        seg_same = tl.load(SEG + head, mask=d_in, other=0.0).to(tl.float32)
        seg_other = tl.load(SEG + H * HEAD_DIM + head, mask=d_in, other=0.0).to(tl.float32)
        q_s = (q + r_s[None, :]) * qk_scale
        e_same = tl.sum(q_s * seg_same[None, :], axis=1)
        e_delta = tl.sum(q_s * (seg_other - seg_same)[None, :], axis=1)
    tl.store(E + out_rows * E_FIELDS + E_SAME, e_same, mask=row_in)
    tl.store(E + out_rows * E_FIELDS + E_DELTA, e_delta, mask=row_in)


@triton.jit
def _grad_operands_kernel(
    DOUT, OUT, LSE, ROWS, E, DO, LSE2, DELTA,
    stride_gb, stride_gm, stride_gh, stride_gd,
    stride_ob, stride_om, stride_oh, stride_od,
    M, H, keep_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The backward's row operands in ROWS order: DO (B, H, M, HEAD_DIM) in the dot dtype, dO times
    the dropout keep scale; DELTA (B, H, M) fp32, rowsum(dO * O); LSE2 (B, H, M) fp32, the forward's
    log-sum-exp in base 2 less the same-segment score E[..., E_SAME] that the recomputed scores
    leave out.

    DOUT, OUT (B, M, H, HEAD_DIM), any strides, and LSE (B, H, M) contiguous, in the caller's rows.
    Grid (cdiv(M, BLOCK_M), B * H)."""
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows, row_in, src, _ = _rows_of_program(ROWS, pid_m, b, M, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    in_mask = row_in[:, None] & (d < HEAD_DIM)[None, :]
    b64 = b.to(tl.int64)
    dout = tl.load(DOUT + b64 * stride_gb + src[:, None] * stride_gm + h * stride_gh + d[None, :] * stride_gd,
                   mask=in_mask, other=0.0).to(tl.float32)
    out = tl.load(OUT + b64 * stride_ob + src[:, None] * stride_om + h * stride_oh + d[None, :] * stride_od,
                  mask=in_mask, other=0.0).to(tl.float32)
    out_rows = pid_bh.to(tl.int64) * M + rows
    tl.store(DELTA + out_rows, tl.sum(dout * out, axis=1), mask=row_in)
    tl.store(DO + (out_rows * HEAD_DIM)[:, None] + d[None, :], (dout * keep_scale).to(DO.dtype.element_ty),
             mask=in_mask)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * M + src, mask=row_in, other=0.0)
    e_same = tl.load(E + out_rows * E_FIELDS + E_SAME, mask=row_in, other=0.0)
    tl.store(LSE2 + out_rows, lse * LOG2E - e_same, mask=row_in)


KERNELS = (_query_operands_kernel, _grad_operands_kernel)
