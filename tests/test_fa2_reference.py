"""The compile report's FlashAttention-2 reference (``bench.compiler.fa2_reference``) computes
attention and its gradients: a reference whose instruction counts are compared must be a working
kernel. Runs in triton's interpreter on CPU (lengths not multiples of the tiles), compiled on a GPU."""

import math

import pytest
import torch

from bench.compiler import fa2_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILES = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


def test_reference_matches_softmax_attention_and_its_gradients():
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    B, M, N, H, D = 2, 24, 40, 2, 16
    q, k, v, dout = (torch.randn(B, L, H, D, generator=g).to(DEVICE) for L in (M, N, N, M))
    scale = 1 / math.sqrt(D)
    out, lse = fa2_reference.forward(q, k, v, scale, **TILES)
    dq, dk, dv = fa2_reference.backward(dout, q, k, v, out, lse, scale, **TILES)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.transpose(1, 2) for t in leaves)
    scores = qh @ kh.transpose(-1, -2) * scale
    expected = (scores.softmax(-1) @ vh).transpose(1, 2)
    expected.backward(dout)
    tol = dict(rtol=2e-2, atol=2e-2) if DEVICE == "cuda" else dict(rtol=1e-4, atol=1e-4)  # tf32 on GPU
    torch.testing.assert_close(out, expected.detach(), **tol)
    torch.testing.assert_close(lse, scores.logsumexp(-1).detach(), **tol)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, **tol)
