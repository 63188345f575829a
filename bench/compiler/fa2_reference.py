"""A plain FlashAttention-2 in Triton: the reference the compile report (``bench.compile_report``)
measures the fused XLNet kernels against. Softmax attention without bias, mask or dropout, online
softmax in base 2.

Layout as the op's: ``q (B, M, H, D)``, ``k, v (B, N, H, D)``; ``lse (B, H, M)`` natural log.
Three kernels: forward (one program per query tile, loop over key tiles), dK/dV (one program per
key tile, loop over query tiles) and dQ (one program per query tile, loop over key tiles); the
backward's ``delta = rowsum(dO * O)`` is a torch reduction, as in the op. Tile sizes and launch
options are arguments (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``, ``maxnreg``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)  # the same constant inside the kernels
# what each kernel computes, in the compile report's words
ROLES = {"_fa2_fwd": "fwd", "_fa2_bwd_kv": "dkdv", "_fa2_bwd_q": "dq"}


@triton.jit
def _batch_head(H):
    """The (batch, head) of this program: grid axis 1 runs over B * H."""
    pid_bh = tl.program_id(1)
    return pid_bh // H, pid_bh % H


@triton.jit
def _probabilities(q_tile, k_tile, lse, cols, N, qk_scale):
    """The softmax probabilities of one (query tile, key tile) from the forward's row log-sum-exp
    (natural log), 0 at the key columns past ``N``."""
    s = tl.dot(q_tile, tl.trans(k_tile)) * qk_scale
    prob = tl.exp2(s - lse[:, None] * LOG2E_C)
    return tl.where((cols < N)[None, :], prob, 0.0)


@triton.jit
def _fa2_fwd(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
             stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
             stride_vb, stride_vn, stride_vh, stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
             H, M, N, D, qk_scale,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    b, h = _batch_head(H)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_tile = tl.load(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
                     mask=(rows < M)[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (cols < N)[:, None] & d_ok[None, :]
        k_tile = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q_tile, tl.trans(k_tile)) * qk_scale
        s = tl.where((cols < N)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, axis=1)
        v_tile = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(prob.to(v_tile.dtype), v_tile)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & d_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + rows, (m_i + tl.log2(l_i)) / LOG2E_C,
             mask=rows < M)


@triton.jit
def _fa2_bwd_kv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                stride_lb, stride_lh, H, M, N, D, sm_scale, qk_scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dK, dV of one key tile; q/dO share strides, and so do k/v/dk/dv."""
    pid_n = tl.program_id(0)
    b, h = _batch_head(H)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kv_off = b * stride_kb + h * stride_kh + cols[:, None] * stride_kn + offs_d[None, :]
    kv_mask = (cols < N)[:, None] & d_ok[None, :]
    k_tile = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
    v_tile = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
    q_base = b * stride_qb + h * stride_qh
    stats_base = b * stride_lb + h * stride_lh
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        q_mask = (rows < M)[:, None] & d_ok[None, :]
        q_off = q_base + rows[:, None] * stride_qm + offs_d[None, :]
        q_tile = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
        do = tl.load(do_ptr + q_off, mask=q_mask, other=0.0)
        lse = tl.load(lse_ptr + stats_base + rows, mask=rows < M, other=float("inf"))
        delta = tl.load(delta_ptr + stats_base + rows, mask=rows < M, other=0.0)
        prob = _probabilities(q_tile, k_tile, lse, cols, N, qk_scale)
        dv += tl.dot(tl.trans(prob.to(do.dtype)), do)
        dp = tl.dot(do, tl.trans(v_tile))
        ds = prob * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q_tile.dtype)), q_tile)
    tl.store(dk_ptr + kv_off, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _fa2_bwd_q(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
               stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
               stride_lb, stride_lh, H, M, N, D, sm_scale, qk_scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dQ of one query tile; q/dO/dq share strides, and so do k/v."""
    pid_m = tl.program_id(0)
    b, h = _batch_head(H)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_off = b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :]
    q_mask = (rows < M)[:, None] & d_ok[None, :]
    q_tile = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    do = tl.load(do_ptr + q_off, mask=q_mask, other=0.0)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + rows, mask=rows < M, other=float("inf"))
    delta = tl.load(delta_ptr + b * stride_lb + h * stride_lh + rows, mask=rows < M, other=0.0)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_kb + h * stride_kh
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        kv_mask = (cols < N)[:, None] & d_ok[None, :]
        k_tile = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v_tile = tl.load(v_base + cols[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        prob = _probabilities(q_tile, k_tile, lse, cols, N, qk_scale)
        dp = tl.dot(do, tl.trans(v_tile))
        ds = prob * (dp - delta[:, None])
        dq += tl.dot(ds.to(k_tile.dtype), k_tile)
    tl.store(dq_ptr + q_off, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def forward(q, k, v, sm_scale: float, **tiles):
    """``out (B, M, H, D)``, ``lse (B, H, M)`` float32; ``tiles``: BLOCK_M, BLOCK_N, launch options."""
    B, M, H, D = q.shape
    N = k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    _fa2_fwd[lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), B * H)](
        q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        lse.stride(0), lse.stride(1), H, M, N, D, sm_scale * LOG2E, BLOCK_D=_block_d(D), **tiles)
    return out, lse


def backward(dout, q, k, v, out, lse, sm_scale: float, **tiles):
    """``dq, dk, dv`` for contiguous ``q, k, v, dout`` (q/dout and k/v with equal strides)."""
    B, M, H, D = q.shape
    N = k.shape[1]
    if dout.stride() != q.stride() or v.stride() != k.stride():
        raise ValueError("the reference backward needs q/dout and k/v laid out alike")
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    lse = lse.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = (*q.stride()[:3], *k.stride()[:3], lse.stride(0), lse.stride(1), H, M, N, D, sm_scale,
              sm_scale * LOG2E)
    _fa2_bwd_kv[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), B * H)](
        q, k, v, dout, lse, delta, dk, dv, *common, BLOCK_D=_block_d(D), **tiles)
    _fa2_bwd_q[lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), B * H)](
        q, k, v, dout, lse, delta, dq, *common, BLOCK_D=_block_d(D), **tiles)
    return dq, dk, dv
