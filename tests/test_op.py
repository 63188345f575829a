"""rel_attention (eager backend) against the float64 reference with the literal rel_shift; the op's
contract: dropout, scale, torch.compile, opcheck, bad input, backend choice, the two-stream call."""

import math
import os
import subprocess
import sys

import pytest
import torch
from helpers.attention import (ARG_NAMES, F64, GRAD_NAMES, draw_query_rows, eager_attention, grads, make_case,
                               seq_first_views)
from helpers.compare import rel_err
from helpers.reference import reference_attention
from hypothesis import given, settings
from hypothesis import strategies as st

import xlnet_fast
from xlnet_fast import INT32_MAX, INT32_MIN, rel_attention


def run_both(case):
    """(eager output, float64 reference output) on ``case``."""
    return case.call(eager_attention), case.call(reference_attention)


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
    case = make_case(**CASES[name])
    dout = torch.randn(case.q.shape, dtype=F64)
    out, g_ours = grads(eager_attention, case, dout)
    ref, g_ref = grads(reference_attention, case, dout)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for n, a, b in zip(GRAD_NAMES, g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"grad {n}")


def test_hf_seq_first_views_work():
    """HF keeps (len, B, H, D) tensors; permuted views with a contiguous last dim are accepted."""
    seq_first = seq_first_views(make_case(seg=False))
    assert not seq_first.q.is_contiguous()
    out, ref = run_both(seq_first)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision_matches_reference(dtype, tol):
    case = make_case(mask="rank", dtype=dtype)
    out = case.call(eager_attention)
    assert out.dtype == dtype
    ref = case.to(dtype=F64).call(reference_attention)
    assert rel_err(out, ref) < tol


def test_fully_blocked_rows_give_zero_output_and_finite_grads():
    case = make_case(mask="rank", self_visible=False, mlen=0)
    case.q_rank[0, 1] = INT32_MIN  # row sees nothing
    case.k_rank[1] = INT32_MAX  # whole batch row sees nothing
    dout = torch.randn(case.q.shape, dtype=F64)
    out, g = grads(eager_attention, case, dout)
    assert torch.all(out[0, 1] == 0) and torch.all(out[1] == 0)
    assert all(torch.isfinite(x).all() for x in g)
    assert torch.all(g[0][0, 1] == 0)  # dq of the blocked row


def test_padding_query_rows_are_zero():
    q_pos = torch.tensor([[-1, 0, 2], [1, -1, -1]])
    out, ref = run_both(make_case(M=3, qlen=4, q_pos=q_pos))
    assert torch.all(out[0, 0] == 0) and torch.all(out[1, 1:] == 0)
    torch.testing.assert_close(out, ref)


def test_dropout_is_reproducible_and_its_gradient_is_exact():
    case = make_case(seg=False, mask="rank")
    kw = case.kwargs()
    leaves = [t.detach().clone().requires_grad_() for t in case.args()]

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
    case = make_case(seg=False)
    a = case.call(eager_attention)
    b = case.call(eager_attention, scale=1 / math.sqrt(case.q.shape[-1]))
    c = case.call(eager_attention, scale=0.1)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, c)


def test_torch_compile_traces_without_graph_breaks():
    case = make_case(mask="rank", dtype=torch.float32)
    kw = case.kwargs()
    leaves = [t.detach().clone().requires_grad_() for t in case.args()]

    def f(*xs):
        return rel_attention(*xs, **kw, backend="eager").sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*leaves), f(*leaves))
    g1 = torch.autograd.grad(compiled(*leaves), leaves)
    g2 = torch.autograd.grad(f(*leaves), leaves)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_library_op_passes_opcheck():
    c = make_case(mask="rank", dtype=torch.float32)
    # the registered op takes every argument positionally; attn_mask and q_pos are None, then
    # self_rows=3, rows_cover_qlen=False, scale=0.5, dropout_p=0.0, seed=None, q_g=None, no tables,
    # backend
    args = c.args() + [c.r_s_bias, c.seg_embed, c.q_seg, c.k_seg, None,
                       c.q_rank, c.k_rank, None, c.qlen, 3, False, 0.5, 0.0, None, None, None, None, "eager"]
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
    q_pos, M = draw_query_rows(g, B, qlen, targets)
    case = make_case(B=B, M=M, H=H, D=D, mlen=mlen, qlen=qlen, Br=B if per_batch else 1, R=K + 1 if uni else None,
                     seg=seg, mask=mask, self_visible=self_visible, q_pos=q_pos, seed=seed)
    dout = torch.randn(case.q.shape, dtype=F64, generator=g)
    ref, g_ref = grads(reference_attention, case, dout)
    if fp32:  # dtype: float32 against the float64 reference
        case = case.to(dtype=torch.float32)
    if seq_first:  # strides: HF's (len, B, H, D) tensors passed as permuted views
        case = seq_first_views(case)
    out, g_ours = grads(eager_attention, case, dout.to(case.q.dtype))
    tol = 1e-4 if fp32 else 1e-8
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for n, a, b in zip(GRAD_NAMES, g_ours, g_ref):
        torch.testing.assert_close(a.double(), b, rtol=tol * 10, atol=tol * 10, msg=f"grad {n}")


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def _base():
    return make_case(seg=False, dtype=torch.float32)


BAD_INPUTS = [  # (change to the inputs or None, call options, error, message)
    (lambda c: c.replace(k=c.k[:, :, :1]), {}, ValueError, "k must have shape"),
    (lambda c: c.replace(v=c.v[:, :-1]), {}, ValueError, "v must have shape"),
    (lambda c: c.replace(k_r=c.k_r[:, :5]), {}, ValueError, "k_r needs at least"),
    (lambda c: c.replace(k_r=c.k_r.expand(3, -1, -1, -1)), {}, ValueError, "k_r must have batch dim"),
    (lambda c: c.replace(r_w_bias=c.r_w_bias.double()), {}, TypeError, "r_w_bias must have dtype"),
    (lambda c: c.replace(q=c.q.int()), {}, TypeError, "q must be"),
    (lambda c: c.replace(q=c.q.repeat_interleave(2, -1)[..., ::2]), {}, ValueError, "contiguous last dim"),
    (lambda c: c.replace(attn_mask=torch.zeros(2, 5, 8, dtype=torch.bool),
                         q_rank=torch.zeros(2, 5, dtype=torch.int32),
                         k_rank=torch.zeros(2, 8, dtype=torch.int32)), {}, ValueError, "not both"),
    (lambda c: c.replace(q_rank=torch.zeros(2, 5, dtype=torch.int32)), {}, ValueError, "together"),
    (lambda c: c.replace(attn_mask=torch.zeros(2, 5, 8)), {}, TypeError, "attn_mask must have dtype"),
    (lambda c: c.replace(q_rank=torch.zeros(2, 5, dtype=torch.int64),
                         k_rank=torch.zeros(2, 8, dtype=torch.int64)), {}, TypeError, "q_rank"),
    (lambda c: c.replace(q_seg=torch.zeros(2, 5, dtype=torch.long)), {}, ValueError, "segment term"),
    (lambda c: c.replace(qlen=9), {}, ValueError, "qlen must be"),
    (lambda c: c.replace(q_pos=torch.tensor([[0, 1, 2, 3, 5]] * 2)), {}, ValueError, "q_pos values"),
    (None, dict(dropout_p=1.0), ValueError, "dropout_p"),
    (None, dict(backend="cuda"), ValueError, "backend must be"),
    (lambda c: c.replace(self_visible=1), {}, TypeError, "self_visible"),
    # regressions (issue 10 item 10): these used to raise from deep inside or be accepted
    (lambda c: c.replace(**{n: getattr(c, n)[..., :0] for n in ARG_NAMES}), {}, ValueError, "head dim"),
    (None, dict(scale=float("nan")), ValueError, "scale must be finite"),
    (None, dict(scale=float("inf")), ValueError, "scale must be finite"),
    # regressions: masks= of another kind raised AttributeError ('Tensor' object has no attribute 'batch');
    # self_visible beside prepared masks went unnamed ("got masks and []")
    (None, dict(masks=torch.zeros(2, 5, 8, dtype=torch.bool)), TypeError, "masks must be the PreparedMasks"),
    (lambda c: c.replace(self_visible=False),
     dict(masks=xlnet_fast.prepare_masks(2, 5, 8, device="cpu")), ValueError, r"got masks and \[.*'self_visible'\]"),
]


@pytest.mark.parametrize("change,options,exc,match", BAD_INPUTS,
                         ids=[f"{exc.__name__}-{match}" for _, _, exc, match in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(change, options, exc, match):
    case = _base() if change is None else change(_base())
    with pytest.raises(exc, match=match):
        case.call(rel_attention, **options)


def test_forced_triton_backend_never_falls_back(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="triton"):
        _base().call(rel_attention, backend="triton")


def test_auto_backend_is_eager_on_cpu():
    assert xlnet_fast.attention.resolve_backend("auto", torch.device("cpu")) == "eager"


def test_eager_out_of_memory_points_to_triton(monkeypatch):
    from xlnet_fast.attention import eager

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(eager, "forward", oom)
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(torch.OutOfMemoryError, match="backend='triton'"):
        xlnet_fast.rel_attention(q, q, q, torch.randn(1, 8, 1, 8), torch.zeros(1, 8), torch.zeros(1, 8),
                                 backend="eager")


def test_self_rows_out_of_range_is_a_value_error():
    from xlnet_fast.attention.args import validate

    c = make_case(mask="rank", dtype=torch.float32)
    M = c.q.shape[1]
    assert validate(*c.args(), q_rank=c.q_rank, k_rank=c.k_rank, qlen=c.qlen, self_rows=1).self_rows == 1
    for bad in (-1, M + 1):
        with pytest.raises(ValueError, match="self_rows"):
            validate(*c.args(), q_rank=c.q_rank, k_rank=c.k_rank, qlen=c.qlen, self_rows=bad)


@pytest.mark.parametrize("mask", [None, "rank", "dense"])
def test_two_stream_equals_two_calls(mask):
    B, L, P, H, D, mlen = 2, 7, 3, 2, 4, 2
    case = make_case(B=B, M=L, H=H, D=D, mlen=mlen, mask=mask)
    q_h = case.q
    q_g = torch.randn(B, P, H, D, dtype=F64)
    target_pos = torch.tensor([[6, 0, 3], [2, -1, 5]])
    rows = target_pos.clamp(min=0)
    rest = case.args()[1:]
    common = dict(r_s_bias=case.r_s_bias, seg_embed=case.seg_embed, k_seg=case.k_seg)
    h_kw = dict(common, q_seg=case.q_seg)
    g_kw = dict(common, q_seg=case.q_seg.gather(1, rows), q_pos=target_pos, qlen=L)
    joint_kw = dict(common, q_seg=case.q_seg, target_pos=target_pos)
    if mask == "rank":
        h_kw.update(q_rank=case.q_rank, k_rank=case.k_rank)
        g_kw.update(q_rank=case.q_rank.gather(1, rows), k_rank=case.k_rank, self_visible=False)
        joint_kw.update(q_rank=case.q_rank, k_rank=case.k_rank)
    if mask == "dense":
        mask_g = torch.rand(B, P, L + mlen) < 0.3
        h_kw.update(attn_mask=case.attn_mask)
        g_kw.update(attn_mask=mask_g)
        joint_kw.update(attn_mask=case.attn_mask, attn_mask_g=mask_g)
    out_h, out_g = xlnet_fast.rel_attention_two_stream(q_h, q_g, *rest, **joint_kw, backend="eager")
    torch.testing.assert_close(out_h, rel_attention(q_h, *rest, **h_kw, backend="eager"))
    torch.testing.assert_close(out_g, rel_attention(q_g, *rest, **g_kw, backend="eager"))


# (keywords of rel_attention_two_stream with B=2, L=7, P=3, K=9 or None, error, message)
_TWO_STREAM_BAD = [
    (dict(target_pos=torch.tensor([[6, 0, 7], [2, -1, 5]])), ValueError, "target_pos values must be < qlen = 7"),
    (dict(target_pos=torch.tensor([[6, 0, 7], [2, -1, 5]]), q_rank=torch.zeros(2, 7, dtype=torch.int32),
          k_rank=torch.zeros(2, 9, dtype=torch.int32)), ValueError, "target_pos values"),
    (dict(target_pos=torch.tensor([[6, 0, 9], [2, -1, 5]]), q_seg=torch.zeros(2, 7, dtype=torch.long),
          k_seg=torch.zeros(2, 9, dtype=torch.long)), ValueError, "target_pos values"),
    (dict(attn_mask=torch.zeros(2, 7, 8, dtype=torch.bool), attn_mask_g=torch.zeros(2, 3, 9, dtype=torch.bool)),
     ValueError, r"attn_mask must have shape \(2, 7, 9\)"),
    (dict(attn_mask=torch.zeros(7, 9, dtype=torch.bool), attn_mask_g=torch.zeros(2, 3, 9, dtype=torch.bool)),
     ValueError, "attn_mask must have 3 dims"),
    (dict(attn_mask=torch.zeros(2, 7, 9, dtype=torch.bool), attn_mask_g=torch.zeros(2, 2, 9, dtype=torch.bool)),
     ValueError, r"attn_mask_g must have shape \(2, 3, 9\)"),
    (dict(attn_mask=torch.zeros(2, 7, 9, dtype=torch.bool), attn_mask_g=torch.zeros(2, 3, 9)),
     TypeError, "attn_mask_g must have dtype"),
    (dict(masks=torch.zeros(2, 10, 9, dtype=torch.bool), target_pos=None), TypeError, "masks must be"),
]


@pytest.mark.parametrize("keywords,exc,match", _TWO_STREAM_BAD, ids=[m for _, _, m in _TWO_STREAM_BAD])
def test_two_stream_bad_masks_raise_naming_the_argument(keywords, exc, match):
    """Regression: the two-stream entry points gathered q_seg and q_rank at target_pos and joined
    attn_mask with attn_mask_g before checking them, so a target position past qlen raised an index
    error (a device assertion on a GPU) and a bad mask was reported as a joined one the caller never
    passed (or a torch error)."""
    case = make_case(B=2, M=7, H=2, D=4, mlen=2, seg=False, dtype=torch.float32)
    q_g = torch.randn(2, 3, 2, 4)
    keywords = dict(dict(target_pos=torch.tensor([[6, 0, 3], [2, -1, 5]])), **keywords)
    if keywords.get("q_seg") is not None:
        keywords.update(r_s_bias=torch.zeros(2, 4), seg_embed=torch.zeros(2, 2, 4))
    with pytest.raises(exc, match=match):
        xlnet_fast.rel_attention_two_stream(case.q, q_g, *case.args()[1:], **keywords, backend="eager")


def test_attention_probabilities_keeps_an_explicit_zero_scale():
    # regression: scale=0.0 was replaced by the default 1/sqrt(D) (`or`), so rows were not uniform
    probs = xlnet_fast.attention.attention_probabilities(*_base().args(), scale=0.0)
    assert torch.allclose(probs, torch.full_like(probs, 1.0 / probs.shape[-1]))


def test_attention_probabilities_are_differentiable_with_masks():
    # regression: masked rows' NaNs were zeroed in place on softmax's output, which autograd needs
    case = make_case(seg=False, mask="dense", dtype=torch.float64)
    leaves = [t.detach().clone().requires_grad_() for t in case.args()]
    probs = xlnet_fast.attention.attention_probabilities(*leaves, **case.kwargs())
    grads_ = torch.autograd.grad((probs * torch.randn_like(probs)).sum(), leaves[:2])
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads_)


def test_q_pos_out_of_range_is_caught_under_torch_compile():
    # regression: the q_pos < qlen check was skipped under torch.compile (garbage, no error)
    case = _base().replace(q_pos=torch.tensor([[0, 1, 2, 3, 5]] * 2))
    kw = case.kwargs()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def call(*xs):
        return rel_attention(*xs, **kw)

    with pytest.raises(RuntimeError, match="q_pos"):
        call(*case.args())


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


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_under_autocast_float32_arguments_are_taken_in_the_autocast_dtype(backend):
    """Regression (first GPU run): under torch.autocast a model's projections come out in bf16 while
    its bias parameters stay float32, and the op refused the mix ("r_w_bias must have dtype in
    ['torch.bfloat16']"). It now computes as on the arguments cast to the autocast dtype, and the
    float32 leaves get float32 gradients."""
    case = make_case(dtype=torch.float32, mask="rank", self_visible=False, seed=3)
    leaves = {name: getattr(case, name).clone().requires_grad_() for name in GRAD_NAMES}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = case.replace(**leaves).call(rel_attention, backend=backend)
    cast = case.replace(**{name: getattr(case, name).to(torch.bfloat16) for name in GRAD_NAMES})
    assert out.dtype == torch.bfloat16
    ref = cast.call(rel_attention, backend=backend)
    assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()
    out.float().square().sum().backward()
    assert all(x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all() for x in leaves.values())
    with pytest.raises(TypeError, match="r_w_bias must have dtype"):  # outside autocast: refused as before
        cast.replace(r_w_bias=case.r_w_bias).call(rel_attention, backend=backend)
