"""Attention test inputs on top of ``bench.cases.OpCall`` (the record of one op call, shared with the
benchmarks): the random builder of every argument form the op takes, the backends' calls, and the
gradients the tests compare."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from bench.cases import ARG_NAMES, GRAD_NAMES, OpCall
from xlnet_fast import INT32_MIN, rel_attention

F64 = torch.float64
__all__ = ["ARG_NAMES", "F64", "GRAD_NAMES", "OpCall", "draw_query_rows", "eager_attention", "grads", "make_case",
           "seq_first_views", "triton_attention"]

eager_attention = functools.partial(rel_attention, backend="eager")
triton_attention = functools.partial(rel_attention, backend="triton")


def seq_first_views(case: OpCall) -> OpCall:
    """q, k, v, k_r as transformers keeps them: ``(len, B, H, D)`` tensors seen as ``(B, len, H, D)``."""
    return case.replace(**{name: getattr(case, name).transpose(0, 1).contiguous().transpose(0, 1)
                           for name in ("q", "k", "v", "k_r")})


def make_case(B=2, M=5, H=2, D=4, mlen=3, qlen=None, Br=1, R=None, seg=True, mask=None,
              self_visible=True, q_pos=None, dtype=F64, seed=0) -> OpCall:
    """Random inputs for one call: ``M`` query rows, ``mlen`` memory keys, ``R`` rows of k_r
    (default ``K + qlen``); ``seg`` adds the segment term; ``mask`` is None, ``"dense"`` (attn_mask)
    or ``"rank"`` (q_rank/k_rank, memory always visible); ``q_pos`` picks the query rows."""
    g = torch.Generator().manual_seed(seed)
    qlen = M if qlen is None else qlen
    K = mlen + qlen
    R = K + qlen if R is None else R

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype)

    case = OpCall(rnd(B, M, H, D), rnd(B, K, H, D), rnd(B, K, H, D), rnd(Br, R, H, D), rnd(H, D), rnd(H, D),
                  qlen=qlen, self_visible=self_visible, q_pos=q_pos)
    if seg:
        k_seg = torch.randint(0, 3, (B, K), generator=g)
        k_seg[:, :mlen] = 0
        q_seg = k_seg[:, mlen:][:, :M] if q_pos is None else k_seg[:, mlen:].gather(1, q_pos.clamp(min=0))
        case = case.replace(r_s_bias=rnd(H, D), seg_embed=rnd(2, H, D), q_seg=q_seg, k_seg=k_seg)
    if mask == "dense":
        case = case.replace(attn_mask=torch.rand(B, M, K, generator=g) < 0.4)
    elif mask == "rank":
        q_rank = torch.randint(0, 5, (B, M), generator=g, dtype=torch.int32)
        k_rank = torch.randint(0, 5, (B, K), generator=g, dtype=torch.int32)
        k_rank[:, :mlen] = INT32_MIN
        case = case.replace(q_rank=q_rank, k_rank=k_rank)
    return case


def draw_query_rows(g: torch.Generator, B: int, qlen: int, targets: bool) -> tuple[Tensor | None, int]:
    """(q_pos, M) for a fuzzed case: all qlen positions in order, or (``targets``) 1..qlen rows at
    random positions, some of them padding (-1)."""
    if not targets:
        return None, qlen
    M = int(torch.randint(1, qlen + 1, (), generator=g))
    return torch.randint(-1, qlen, (B, M), generator=g), M


def grads(fn, case: OpCall, dout: Tensor):
    """``fn``'s output on ``case`` and the gradients of ``(out * dout).sum()`` with respect to each
    differentiable input that is set, in GRAD_NAMES order (zeros where the output does not depend on it)."""
    leaves = {name: getattr(case, name).detach().clone().requires_grad_()
              for name in GRAD_NAMES if getattr(case, name) is not None}
    out = case.replace(**leaves).call(fn)
    gs = torch.autograd.grad((out * dout).sum(), list(leaves.values()), allow_unused=True)
    return out, [torch.zeros_like(x) if g is None else g for g, x in zip(gs, leaves.values())]
