"""Attention test cases as named records, the backends' calls, and the gradients the tests compare."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from xlnet_fast import INT32_MIN, rel_attention

F64 = torch.float64
ARG_NAMES = ("q", "k", "v", "k_r", "r_w_bias", "r_r_bias")  # rel_attention's positional arguments
GRAD_NAMES = ARG_NAMES + ("r_s_bias", "seg_embed")  # its differentiable inputs, in grads()' order

eager_attention = functools.partial(rel_attention, backend="eager")
triton_attention = functools.partial(rel_attention, backend="triton")


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """The inputs of one ``rel_attention`` call; a keyword left at None is not passed.

    Shapes: ``q (B, M, H, D)``; ``k, v (B, K, H, D)``, ``K = mlen + qlen``; ``k_r (Br, R, H, D)``;
    biases ``(H, D)``; ``seg_embed (2, H, D)``; ``q_seg, q_rank, q_pos (B, M)``; ``k_seg, k_rank
    (B, K)``; ``attn_mask (B, M, K)``.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    k_r: Tensor
    r_w_bias: Tensor
    r_r_bias: Tensor
    qlen: int
    self_visible: bool = True
    q_pos: Tensor | None = None
    r_s_bias: Tensor | None = None
    seg_embed: Tensor | None = None
    q_seg: Tensor | None = None
    k_seg: Tensor | None = None
    attn_mask: Tensor | None = None
    q_rank: Tensor | None = None
    k_rank: Tensor | None = None

    def args(self) -> list[Tensor]:
        """The positional arguments, in ARG_NAMES order."""
        return [getattr(self, name) for name in ARG_NAMES]

    def kwargs(self) -> dict:
        """The keyword arguments that are set (not None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ARG_NAMES and getattr(self, f.name) is not None}

    def call(self, fn, **options):
        """``fn(*args, **kwargs, **options)``: rel_attention, a backend, or the reference."""
        return fn(*self.args(), **self.kwargs(), **options)

    def replace(self, **changes) -> AttentionCase:
        return dataclasses.replace(self, **changes)

    def to(self, device=None, dtype=None) -> AttentionCase:
        """Floating-point tensors cast to ``dtype``, then every tensor moved to ``device``."""
        def move(value):
            if not torch.is_tensor(value):
                return value
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            return value if device is None else value.to(device)

        return self.replace(**{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)})

    def seq_first_views(self) -> AttentionCase:
        """q, k, v, k_r as transformers keeps them: ``(len, B, H, D)`` tensors seen as ``(B, len, H, D)``."""
        return self.replace(**{name: getattr(self, name).transpose(0, 1).contiguous().transpose(0, 1)
                               for name in ("q", "k", "v", "k_r")})


def make_case(B=2, M=5, H=2, D=4, mlen=3, qlen=None, Br=1, R=None, seg=True, mask=None,
              self_visible=True, q_pos=None, dtype=F64, seed=0) -> AttentionCase:
    """Random inputs for one call: ``M`` query rows, ``mlen`` memory keys, ``R`` rows of k_r
    (default ``K + qlen``); ``seg`` adds the segment term; ``mask`` is None, ``"dense"`` (attn_mask)
    or ``"rank"`` (q_rank/k_rank, memory always visible); ``q_pos`` picks the query rows."""
    g = torch.Generator().manual_seed(seed)
    qlen = M if qlen is None else qlen
    K = mlen + qlen
    R = K + qlen if R is None else R

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype)

    case = AttentionCase(rnd(B, M, H, D), rnd(B, K, H, D), rnd(B, K, H, D), rnd(Br, R, H, D), rnd(H, D), rnd(H, D),
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


def grads(fn, case: AttentionCase, dout: Tensor):
    """``fn``'s output on ``case`` and the gradients of ``(out * dout).sum()`` with respect to each
    differentiable input that is set, in GRAD_NAMES order (zeros where the output does not depend on it)."""
    leaves = {name: getattr(case, name).detach().clone().requires_grad_()
              for name in GRAD_NAMES if getattr(case, name) is not None}
    out = case.replace(**leaves).call(fn)
    gs = torch.autograd.grad((out * dout).sum(), list(leaves.values()), allow_unused=True)
    return out, [torch.zeros_like(x) if g is None else g for g, x in zip(gs, leaves.values())]
