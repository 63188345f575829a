"""rel_attention (eager backend) against the float64 reference with the literal rel_shift."""

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from xlnet_reference import reference_attention

import xlnet_fast
from xlnet_fast import INT32_MAX, INT32_MIN, rel_attention

F64 = torch.float64


def make_case(B=2, M=5, H=2, D=4, mlen=3, qlen=None, Br=1, R=None, seg=True, mask=None,
              self_visible=True, q_pos=None, dtype=F64, seed=0):
    """Random inputs and keyword arguments for one call."""
    g = torch.Generator().manual_seed(seed)
    qlen = M if qlen is None else qlen
    K = mlen + qlen
    R = K + qlen if R is None else R

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype)

    tensors = [rnd(B, M, H, D), rnd(B, K, H, D), rnd(B, K, H, D), rnd(Br, R, H, D), rnd(H, D), rnd(H, D)]
    kw = dict(qlen=qlen, self_visible=self_visible)
    if q_pos is not None:
        kw["q_pos"] = q_pos
    if seg:
        k_seg = torch.randint(0, 3, (B, K), generator=g)
        k_seg[:, :mlen] = 0
        q_seg = k_seg[:, mlen:][:, :M] if q_pos is None else k_seg[:, mlen:].gather(1, q_pos.clamp(min=0))
        kw.update(r_s_bias=rnd(H, D), seg_embed=rnd(2, H, D), q_seg=q_seg, k_seg=k_seg)
    if mask == "dense":
        kw["attn_mask"] = torch.rand(B, M, K, generator=g) < 0.4
    elif mask == "rank":
        kw["q_rank"] = torch.randint(0, 5, (B, M), generator=g, dtype=torch.int32)
        k_rank = torch.randint(0, 5, (B, K), generator=g, dtype=torch.int32)
        k_rank[:, :mlen] = INT32_MIN
        kw["k_rank"] = k_rank
    return tensors, kw


def run_both(tensors, kw):
    ours = rel_attention(*tensors, **kw, backend="eager")
    ref = reference_attention(*tensors, **{k: v for k, v in kw.items()})
    return ours, ref


GRAD_NAMES = ["q", "k", "v", "k_r", "r_w_bias", "r_r_bias", "r_s_bias", "seg_embed"]


def grads(fn, tensors, kw, dout):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    kw = dict(kw)
    if "r_s_bias" in kw:
        seg_leaves = [kw["r_s_bias"].detach().clone().requires_grad_(),
                      kw["seg_embed"].detach().clone().requires_grad_()]
        kw["r_s_bias"], kw["seg_embed"] = seg_leaves
        leaves += seg_leaves
    out = fn(*leaves[:6], **kw)
    gs = torch.autograd.grad((out * dout).sum(), leaves, allow_unused=True)
    return out, [torch.zeros_like(x) if g is None else g for g, x in zip(gs, leaves)]


CASES = {
    "content": dict(),
    "no_mem": dict(mlen=0),
    "no_seg": dict(seg=False),
    "dense_mask": dict(mask="dense"),
    "rank_content": dict(mask="rank", self_visible=True),
    "rank_query": dict(mask="rank", self_visible=False),
    "per_batch_k_r": dict(Br=2),
    "uni": dict(R=9),  # K + 1 rows: scores past the end of k_r are masked
    "extra_k_r_rows": dict(R=20),
    "target_rows": dict(M=4, qlen=6, mask="rank", self_visible=False,
                        q_pos=torch.tensor([[5, 0, -1, 2], [3, 1, 4, -1]])),
    "target_rows_uni": dict(M=3, qlen=6, R=10, q_pos=torch.tensor([[5, 0, 2], [3, -1, 4]])),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_grads_match_float64_reference(name):
    tensors, kw = make_case(**CASES[name])
    dout = torch.randn(tensors[0].shape, dtype=F64)
    out, g_ours = grads(lambda *a, **k: rel_attention(*a, **k, backend="eager"), tensors, kw, dout)
    ref, g_ref = grads(reference_attention, tensors, kw, dout)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for n, a, b in zip(GRAD_NAMES, g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"grad {n}")


def test_hf_seq_first_views_work():
    """HF keeps (len, B, H, D) tensors; permuted views with a contiguous last dim are accepted."""
    tensors, kw = make_case(seg=False)
    seq_first = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in tensors[:4]]
    assert not seq_first[0].is_contiguous()
    out, ref = run_both(seq_first + tensors[4:], kw)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision_matches_reference(dtype, tol):
    tensors, kw = make_case(mask="rank", dtype=dtype)
    kw_ref = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}
    out = rel_attention(*tensors, **kw, backend="eager")
    assert out.dtype == dtype
    ref = reference_attention(*[t.double() for t in tensors], **kw_ref)
    assert (out.double() - ref).norm() / ref.norm() < tol


def test_fully_blocked_rows_give_zero_output_and_finite_grads():
    tensors, kw = make_case(mask="rank", self_visible=False, mlen=0)
    kw["q_rank"][0, 1] = INT32_MIN  # row sees nothing
    kw["k_rank"][1] = INT32_MAX  # whole batch row sees nothing
    dout = torch.randn(tensors[0].shape, dtype=F64)
    out, g = grads(lambda *a, **k: rel_attention(*a, **k, backend="eager"), tensors, kw, dout)
    assert torch.all(out[0, 1] == 0) and torch.all(out[1] == 0)
    assert all(torch.isfinite(x).all() for x in g)
    assert torch.all(g[0][0, 1] == 0)  # dq of the blocked row


def test_padding_query_rows_are_zero():
    q_pos = torch.tensor([[-1, 0, 2], [1, -1, -1]])
    tensors, kw = make_case(M=3, qlen=4, q_pos=q_pos)
    out, ref = run_both(tensors, kw)
    assert torch.all(out[0, 0] == 0) and torch.all(out[1, 1:] == 0)
    torch.testing.assert_close(out, ref)


def test_dropout_is_reproducible_and_its_gradient_is_exact():
    tensors, kw = make_case(seg=False, mask="rank")
    leaves = [t.detach().clone().requires_grad_() for t in tensors]

    def f(*xs):
        torch.manual_seed(1234)  # the op draws its dropout seed from torch's RNG
        return rel_attention(*xs, **kw, dropout_p=0.3, backend="eager")

    a, b = f(*leaves), f(*leaves)
    torch.testing.assert_close(a, b)
    no_drop = rel_attention(*leaves, **kw, backend="eager")
    assert not torch.allclose(a, no_drop)
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-6)


def test_dropout_keeps_expectation():
    B, M, H, D, K = 1, 8, 1, 4, 8
    q = torch.zeros(B, M, H, D, dtype=F64)  # uniform attention
    k = torch.zeros(B, K, H, D, dtype=F64)
    v = torch.ones(B, K, H, D, dtype=F64)
    k_r = torch.zeros(1, K + M, H, D, dtype=F64)
    bias = torch.zeros(H, D, dtype=F64)
    outs = torch.stack([rel_attention(q, k, v, k_r, bias, bias, dropout_p=0.5, backend="eager")
                        for _ in range(200)])
    assert abs(outs.mean().item() - 1.0) < 0.05


def test_default_scale_is_inverse_sqrt_d():
    tensors, kw = make_case(seg=False)
    a = rel_attention(*tensors, **kw, backend="eager")
    b = rel_attention(*tensors, **kw, scale=1 / math.sqrt(tensors[0].shape[-1]), backend="eager")
    c = rel_attention(*tensors, **kw, scale=0.1, backend="eager")
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_torch_compile_traces_without_graph_breaks():
    tensors, kw = make_case(mask="rank", dtype=torch.float32)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]

    def f(*xs):
        return rel_attention(*xs, **kw, backend="eager").sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*leaves), f(*leaves))
    g1 = torch.autograd.grad(compiled(*leaves), leaves)
    g2 = torch.autograd.grad(f(*leaves), leaves)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_library_op_passes_opcheck():
    tensors, kw = make_case(mask="rank", dtype=torch.float32)
    args = tensors + [kw["r_s_bias"], kw["seg_embed"], kw["q_seg"], kw["k_seg"], None,
                      kw["q_rank"], kw["k_rank"], None, kw["qlen"], 3, False, 0.5, 0.0, None, "eager"]
    args[0] = args[0].requires_grad_()
    torch.library.opcheck(torch.ops.xlnet_fast.rel_attention.default, args)


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 2), D=st.sampled_from([2, 4]), qlen=st.integers(1, 5),
    mlen=st.integers(0, 3), targets=st.booleans(), mask=st.sampled_from([None, "dense", "rank"]),
    self_visible=st.booleans(), seg=st.booleans(), uni=st.booleans(), per_batch=st.booleans(),
    seq_first=st.booleans(), fp32=st.booleans(), seed=st.integers(0, 1000),
)
def test_fuzz_against_reference(B, H, D, qlen, mlen, targets, mask, self_visible, seg, uni,
                                 per_batch, seq_first, fp32, seed):
    g = torch.Generator().manual_seed(seed)
    K = qlen + mlen
    q_pos, M = None, qlen
    if targets:
        M = int(torch.randint(1, qlen + 1, (), generator=g))
        q_pos = torch.randint(-1, qlen, (B, M), generator=g)
    tensors, kw = make_case(B=B, M=M, H=H, D=D, mlen=mlen, qlen=qlen, Br=B if per_batch else 1,
                            R=K + 1 if uni else None, seg=seg, mask=mask, self_visible=self_visible,
                            q_pos=q_pos, seed=seed)
    dout = torch.randn(tensors[0].shape, dtype=F64, generator=g)
    ref, g_ref = grads(reference_attention, tensors, kw, dout)
    if fp32:  # dtype: float32 against the float64 reference
        tensors = [t.float() for t in tensors]
        kw = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}
    if seq_first:  # strides: HF's (len, B, H, D) tensors passed as permuted views
        tensors = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in tensors[:4]] + tensors[4:]
    out, g_ours = grads(lambda *a, **k: rel_attention(*a, **k, backend="eager"), tensors, kw, dout.to(tensors[0].dtype))
    tol = 1e-4 if fp32 else 1e-8
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for n, a, b in zip(GRAD_NAMES, g_ours, g_ref):
        torch.testing.assert_close(a.double(), b, rtol=tol * 10, atol=tol * 10, msg=f"grad {n}")


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def _base():
    tensors, kw = make_case(seg=False, dtype=torch.float32)
    return tensors, kw


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda t, kw: t.__setitem__(1, t[1][:, :, :1]), ValueError, "k must have shape"),
    (lambda t, kw: t.__setitem__(2, t[2][:, :-1]), ValueError, "v must have shape"),
    (lambda t, kw: t.__setitem__(3, t[3][:, :5]), ValueError, "k_r needs at least"),
    (lambda t, kw: t.__setitem__(3, t[3].expand(3, -1, -1, -1)), ValueError, "k_r must have batch dim"),
    (lambda t, kw: t.__setitem__(4, t[4].double()), TypeError, "r_w_bias must have dtype"),
    (lambda t, kw: t.__setitem__(0, t[0].int()), TypeError, "q must be"),
    (lambda t, kw: t.__setitem__(0, t[0].repeat_interleave(2, -1)[..., ::2]), ValueError, "contiguous last dim"),
    (lambda t, kw: kw.update(attn_mask=torch.zeros(2, 5, 8, dtype=torch.bool),
                             q_rank=torch.zeros(2, 5, dtype=torch.int32),
                             k_rank=torch.zeros(2, 8, dtype=torch.int32)), ValueError, "not both"),
    (lambda t, kw: kw.update(q_rank=torch.zeros(2, 5, dtype=torch.int32)), ValueError, "together"),
    (lambda t, kw: kw.update(attn_mask=torch.zeros(2, 5, 8)), TypeError, "attn_mask must have dtype"),
    (lambda t, kw: kw.update(q_rank=torch.zeros(2, 5, dtype=torch.int64),
                             k_rank=torch.zeros(2, 8, dtype=torch.int64)), TypeError, "q_rank"),
    (lambda t, kw: kw.update(q_seg=torch.zeros(2, 5, dtype=torch.long)), ValueError, "segment term"),
    (lambda t, kw: kw.update(qlen=9), ValueError, "qlen must be"),
    (lambda t, kw: kw.update(q_pos=torch.tensor([[0, 1, 2, 3, 5]] * 2)), ValueError, "q_pos values"),
    (lambda t, kw: kw.update(dropout_p=1.0), ValueError, "dropout_p"),
    (lambda t, kw: kw.update(backend="cuda"), ValueError, "backend must be"),
    (lambda t, kw: kw.update(self_visible=1), TypeError, "self_visible"),
    # regressions (issue 10 item 10): these used to raise from deep inside or be accepted
    (lambda t, kw: [t.__setitem__(i, t[i][..., :0]) for i in range(6)], ValueError, "head dim"),
    (lambda t, kw: kw.update(scale=float("nan")), ValueError, "scale must be finite"),
    (lambda t, kw: kw.update(scale=float("inf")), ValueError, "scale must be finite"),
])
def test_bad_input_raises_naming_the_argument(mutate, exc, match):
    tensors, kw = _base()
    mutate(tensors, kw)
    with pytest.raises(exc, match=match):
        rel_attention(*tensors, **kw)


def test_forced_triton_backend_never_falls_back(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tensors, kw = _base()
    with pytest.raises(RuntimeError, match="triton"):
        rel_attention(*tensors, **kw, backend="triton")


def test_auto_backend_is_eager_on_cpu():
    assert xlnet_fast.attention.resolve_backend("auto", torch.device("cpu")) == "eager"


@pytest.mark.parametrize("mask", [None, "rank", "dense"])
def test_two_stream_equals_two_calls(mask):
    B, L, P, H, D, mlen = 2, 7, 3, 2, 4, 2
    tensors, kw = make_case(B=B, M=L, H=H, D=D, mlen=mlen, mask=mask)
    q_h = tensors[0]
    q_g = torch.randn(B, P, H, D, dtype=F64)
    target_pos = torch.tensor([[6, 0, 3], [2, -1, 5]])
    rows = target_pos.clamp(min=0)
    rest = tensors[1:]
    common = {k: kw[k] for k in ("r_s_bias", "seg_embed", "k_seg")}
    h_kw = dict(common, q_seg=kw["q_seg"])
    g_kw = dict(common, q_seg=kw["q_seg"].gather(1, rows), q_pos=target_pos, qlen=L)
    joint_kw = dict(common, q_seg=kw["q_seg"], target_pos=target_pos)
    if mask == "rank":
        h_kw.update(q_rank=kw["q_rank"], k_rank=kw["k_rank"])
        g_kw.update(q_rank=kw["q_rank"].gather(1, rows), k_rank=kw["k_rank"], self_visible=False)
        joint_kw.update(q_rank=kw["q_rank"], k_rank=kw["k_rank"])
    if mask == "dense":
        mask_g = torch.rand(B, P, L + mlen) < 0.3
        h_kw.update(attn_mask=kw["attn_mask"])
        g_kw.update(attn_mask=mask_g)
        joint_kw.update(attn_mask=kw["attn_mask"], attn_mask_g=mask_g)
    out_h, out_g = xlnet_fast.rel_attention_two_stream(q_h, q_g, *rest, **joint_kw, backend="eager")
    torch.testing.assert_close(out_h, rel_attention(q_h, *rest, **h_kw, backend="eager"))
    torch.testing.assert_close(out_g, rel_attention(q_g, *rest, **g_kw, backend="eager"))


def test_attention_probabilities_keeps_an_explicit_zero_scale():
    # regression: scale=0.0 was replaced by the default 1/sqrt(D) (`or`), so rows were not uniform
    tensors, kw = _base()
    probs = xlnet_fast.attention.attention_probabilities(*tensors, scale=0.0)
    assert torch.allclose(probs, torch.full_like(probs, 1.0 / probs.shape[-1]))


def test_q_pos_out_of_range_is_caught_under_torch_compile():
    # regression: the q_pos < qlen check was skipped under torch.compile (garbage, no error)
    tensors, kw = _base()
    kw.update(q_pos=torch.tensor([[0, 1, 2, 3, 5]] * 2))

    @torch.compile(backend="aot_eager", fullgraph=True)
    def call(*xs):
        return rel_attention(*xs, **kw)

    with pytest.raises(RuntimeError, match="q_pos"):
        call(*tensors)


def test_cpu_calls_without_the_interpreter_leave_the_kernels_unimported():
    # regression: resolving backend="triton" (or "auto") for CPU tensors without TRITON_INTERPRET
    # imported xlnet_fast.kernels, which Triton then compiled for a GPU; a later interpreted call in
    # the same process failed with "0 active drivers"
    code = ("import sys, torch, xlnet_fast\n"
            "from xlnet_fast.attention import resolve_backend\n"
            "assert resolve_backend('auto', torch.device('cpu')) == 'eager'\n"
            "try:\n    resolve_backend('triton', torch.device('cpu'))\nexcept RuntimeError as e:\n"
            "    assert 'TRITON_INTERPRET' in str(e)\nelse:\n    raise AssertionError('no error')\n"
            "assert 'xlnet_fast.kernels' not in sys.modules\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
