"""Fused Triton kernels for XLNet relative attention (installed as ``xlnet_fast.kernels``).

The backend interface used by ``xlnet_fast.ops``: ``available()``, ``check_supported(...)``,
``forward(q, k, v, k_r, r_w_bias, r_r_bias, args) -> (out, lse)`` and
``backward(dout, q, k, v, k_r, r_w_bias, r_r_bias, args, out, lse) -> 8 gradients``.
"""

from __future__ import annotations

import os

import torch

_IMPORT_ERROR: str | None = None
try:
    import triton

    from . import rel_attention as _k
except Exception as exc:  # pragma: no cover - depends on the install
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def available() -> tuple[bool, str]:
    """(usable, reason) for the Triton backend."""
    if _IMPORT_ERROR is not None:
        return False, f"triton is not importable ({_IMPORT_ERROR})"
    version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    if version < (3, 3):
        return False, f"triton {triton.__version__} is older than 3.3"
    return True, f"triton {triton.__version__}"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_r: torch.Tensor) -> None:
    """Raise ``ValueError`` for inputs the kernels do not handle (called before any launch)."""
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton backend supports {[str(d) for d in SUPPORTED_DTYPES]}, got q.dtype={q.dtype}")
    D = q.shape[-1]
    if D > 256:
        raise ValueError(f"the Triton backend supports head dims up to 256, got D={D}")


def _dot_dtype(dtype: torch.dtype):
    import triton.language as tl

    if dtype == torch.bfloat16 and _interpreting():
        # triton's CPU interpreter computes bf16 dots wrongly (numpy has no bf16): use fp32
        # operands there; on a GPU the dots take bf16 operands with fp32 accumulation.
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def _input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not _interpreting():
        return "tf32"
    return "ieee"


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def _opt(t, dummy):
    return dummy if t is None else t


def _strides(t, n):
    return tuple(t.stride()[:n]) if t is not None else (0,) * n


def _common(q, k, v, k_r, r_w_bias, r_r_bias, a):
    """Kernel arguments shared by the forward and the backward launches."""
    B, M, H, D = q.shape
    K, R = k.shape[1], k_r.shape[1]
    dummy = q.new_empty(1)
    idummy = torch.zeros(1, dtype=torch.int32, device=q.device)
    has_seg = a.seg_embed is not None
    mask_mode = 1 if a.attn_mask is not None else (2 if a.q_rank is not None else 0)
    mask = a.attn_mask.view(torch.uint8) if a.attn_mask is not None else None
    r_w_bias, r_r_bias = r_w_bias.contiguous(), r_r_bias.contiguous()
    seg_bias = a.r_s_bias.contiguous() if has_seg else r_w_bias
    seg = a.seg_embed.contiguous() if has_seg else dummy.expand(2, H, D)
    ptrs = (q, k, v, k_r, r_w_bias, r_r_bias, seg_bias, seg, _opt(a.q_seg, idummy), _opt(a.k_seg, idummy),
            _opt(mask, idummy), _opt(a.q_rank, idummy), _opt(a.k_rank, idummy), _opt(a.q_pos, idummy))
    krb = k_r.stride(0) if k_r.shape[0] > 1 else 0
    strides = (
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), krb, k_r.stride(1), k_r.stride(2),
        r_w_bias.stride(0), seg.stride(0), seg.stride(1),
        *_strides(a.q_seg, 2), *_strides(a.k_seg, 2), *_strides(mask, 3),
        *_strides(a.q_rank, 2), *_strides(a.k_rank, 2), *_strides(a.q_pos, 2),
    )
    flags = dict(HAS_SEG=has_seg, MASK_MODE=mask_mode, SELF_VISIBLE=a.self_rows > 0,
                 HAS_QPOS=a.q_pos is not None, CHECK_R=R < K + a.qlen, DROPOUT=a.dropout_p > 0,
                 BLOCK_D=_block_d(D), DOT_DTYPE=_dot_dtype(q.dtype),
                 INPUT_PRECISION=_input_precision(q.dtype))
    seed = int(a.seed.item()) if a.seed is not None else 0
    sizes = (H, M, K, R, D, a.qlen, K - a.qlen, a.self_rows, a.scale * _k.LOG2E, seed % (2**31 - 1), float(a.dropout_p))
    return ptrs, strides, sizes, flags


def _tiles() -> dict:
    if _interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    return {}


def forward(q, k, v, k_r, r_w_bias, r_r_bias, a):
    """Fused forward. Returns ``out (B, M, H, D)`` in q's dtype and ``lse (B, H, M)`` float32."""
    B, M, H, D = q.shape
    out = torch.empty((B, M, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    ptrs, strides, sizes, flags = _common(q, k, v, k_r, r_w_bias, r_r_bias, a)
    tiles = _tiles()
    kernel = _k._fwd_kernel if tiles else _k.fwd_kernel_tuned

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]), B * H)

    kernel[grid](*ptrs, out, lse, *strides, out.stride(0), out.stride(1), out.stride(2),
                 lse.stride(0), lse.stride(1), *sizes, **flags, **tiles)
    return out, lse


def backward(dout, q, k, v, k_r, r_w_bias, r_r_bias, a, out, lse, deterministic: bool | None = None):
    """Fused backward: gradients for q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed.

    ``deterministic`` (default: ``torch.are_deterministic_algorithms_enabled()``) computes dk_r in a
    kernel that owns each tile of k_r rows instead of with fp32 atomics.
    """
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    B, M, H, D = q.shape
    K, Br, R = k.shape[1], k_r.shape[0], k_r.shape[1]
    if dout.stride(-1) != 1:
        # the kernels read dO rows with a unit last-dim stride; `out.sum().backward()` hands us an
        # expanded (stride 0) gradient, so make such a one contiguous
        dout = dout.contiguous()
    ptrs, strides, sizes, flags = _common(q, k, v, k_r, r_w_bias, r_r_bias, a)
    BD = flags["BLOCK_D"]
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # (B, H, M)
    lse = lse.contiguous()
    grad_io = (dout, dout.stride(0), dout.stride(1), dout.stride(2), lse, delta, lse.stride(0), lse.stride(1))
    dq = torch.empty((B, M, H, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, K, H, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, K, H, D), dtype=v.dtype, device=q.device)
    dkr = torch.zeros((Br, R, H, D), dtype=torch.float32, device=q.device)
    dkr_strides = (dkr.stride(0) if Br > 1 else 0, dkr.stride(1), dkr.stride(2))
    tiles = _tiles()
    # room for the partial sums of the smallest BLOCK_M any config may pick (zeroed, unused rest)
    n_m_tiles = triton.cdiv(M, tiles.get("BLOCK_M") or min(cfg.kwargs["BLOCK_M"] for cfg in _k._configs()))
    part = torch.zeros((B * H, n_m_tiles, 6, BD), dtype=torch.float32, device=q.device)
    scale = float(a.scale)

    kv = _k._bwd_kv_kernel if tiles else _k.bwd_kv_kernel_tuned
    kv[lambda m: (triton.cdiv(K, m["BLOCK_N"]), B * H)](
        *ptrs, *strides, *sizes, *grad_io, dk, dv, dk.stride(0), dk.stride(1), dk.stride(2),
        dkr, *dkr_strides, scale, **flags, DKR_ATOMIC=not deterministic, **tiles)
    qk = _k._bwd_q_kernel if tiles else _k.bwd_q_kernel_tuned
    qk[lambda m: (triton.cdiv(M, m["BLOCK_M"]), B * H)](
        *ptrs, *strides, *sizes, *grad_io, dq, dq.stride(0), dq.stride(1), dq.stride(2), part,
        n_m_tiles, scale, **flags, **tiles)
    if deterministic:
        fixed = tiles or dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
        _k._bwd_kr_kernel[(triton.cdiv(R, fixed["BLOCK_N"]), Br * H)](
            *ptrs, *strides, *sizes, *grad_io, dkr, *dkr_strides, B // Br, scale, **flags, **fixed)

    sums = part.view(B, H, n_m_tiles, 6, BD).sum((0, 2))[..., :D]  # (H, 6, D)
    dr_w, dr_r = sums[:, 0].clone(), sums[:, 1].clone()
    if a.seg_embed is not None:
        g = sums[:, 4:6, 0]  # (H, 2): sum of dS over same / different-segment keys
        seg = a.seg_embed.float()
        dr_s = g[:, 0, None] * seg[0] + g[:, 1, None] * seg[1]
        dseg = torch.stack([sums[:, 2], sums[:, 3]])
        dr_s, dseg = dr_s.to(a.r_s_bias.dtype), dseg.to(a.seg_embed.dtype)
    else:
        dr_s = torch.zeros_like(r_w_bias)
        dseg = torch.zeros((2, H, D), dtype=r_w_bias.dtype, device=q.device)
    return dq, dk, dv, dkr.to(k_r.dtype), dr_w.to(r_w_bias.dtype), dr_r.to(r_r_bias.dtype), dr_s, dseg
