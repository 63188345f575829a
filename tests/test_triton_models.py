"""The Triton backend at model level, at a weight scale where every term matters
(``helpers.models.SCALE``), against the eager backend (itself checked against transformers and the
float64 references): XLNet's bi_data, clamp_len, causal attention with same_length, a soft
target_mapping and output_attentions (the query stream in a launch of its own), both streams with
segments and mems in a training step; Transformer-XL's div_val, pre_lnorm, same_length, clamp_len,
shared biases and generation. Each shows first that the term it checks moves the eager outputs far
above the tolerance, and that every attention ran on the Triton backend (``helpers.spy``).

And the op's claims: it keeps O(L) for its backward (what autograd saves, inspected), a forced
backend never falls back under Triton's interpreter either, and Triton's dropout keeps its rate and
the output's expectation.

On a CPU in Triton's interpreter (tiny shapes), on a GPU the compiled kernels.
"""

import os

import pytest
import torch
from helpers.attention import F64, GRAD_NAMES, make_case
from helpers.compare import rel_err
from helpers.models import SCALE, assert_visible, scaled_hf_model, token_ids, without_positions
from helpers.spy import OpCalls
from helpers.transfo_xl import CONFIGS, hf4_config, layout_state

import xlnet_fast
from xlnet_fast import TransfoXLConfig, TransfoXLLMHeadModel, rel_attention

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5  # fp32 kernels against the fp32 eager path: outputs (relative, whole tensors)
GRAD_TOL = 1e-4  # and gradients
B, L = 2, 20
TOKEN_TYPES = (torch.arange(L) >= 12).long().expand(B, L).clone()
TOKEN_TYPES[1, :4] = 1
TOKEN_TYPES = TOKEN_TYPES.to(DEVICE)


def pair(name="XLNetLMHeadModel", **overrides):
    """(eager, triton) xlnet_fast models with the weights of one transformers model at SCALE."""
    hf = scaled_hf_model(name, **overrides)
    return tuple(xlnet_fast.from_hf(hf, backend=b).eval().to(DEVICE) for b in ("eager", "triton"))


def ids(seed, batch=B, length=L):
    return token_ids(batch, length, seed).to(DEVICE)


def on_triton(model, *args, **kwargs):
    """``model(*args, **kwargs)``, asserting every attention call ran on the Triton backend."""
    with OpCalls() as ops:
        out = model(*args, **kwargs)
    assert ops.count() >= model.config.n_layer and ops.backends() == {"triton"}, ops.calls
    return out


def second_call(model, **kw):
    """The logits of a call over the mems of a first one (mlen = mem_len), and its new mems."""
    first = model(ids(1), **kw)
    out = model(ids(2), mems=first.mems, **kw)
    return out.logits, out.mems


# (config overrides, the overrides without the term checked)
POSITION_OPTIONS = {
    "bi_data_clamp_len": ({"bi_data": True, "clamp_len": 5}, {"bi_data": True}),
    "bi_data": ({"bi_data": True}, {}),
    "uni_same_length": ({"attn_type": "uni", "same_length": True}, {"attn_type": "uni"}),
}


@pytest.mark.parametrize("name", sorted(POSITION_OPTIONS))
def test_xlnet_position_options_on_triton(name):
    """Two calls over mems with segments: per-row k_r (bi_data), clamped distances, causal ranks and
    the same_length mask on the fused kernels."""
    overrides, without = POSITION_OPTIONS[name]
    eager, fused = pair(**overrides)
    with torch.no_grad():
        expected, mems = second_call(eager, token_type_ids=TOKEN_TYPES)
        assert_visible("the positions", second_call(without_positions(eager), token_type_ids=TOKEN_TYPES)[0],
                       expected, TOL)
        other = xlnet_fast.from_hf(scaled_hf_model("XLNetLMHeadModel", **without), backend="eager").eval().to(DEVICE)
        assert_visible(name, second_call(other, token_type_ids=TOKEN_TYPES)[0], expected, TOL)
        first = on_triton(fused, ids(1), token_type_ids=TOKEN_TYPES)
        out = on_triton(fused, ids(2), mems=first.mems, token_type_ids=TOKEN_TYPES)
    assert rel_err(out.logits, expected) < TOL, rel_err(out.logits, expected)
    for a, b in zip(out.mems, mems, strict=True):
        assert rel_err(a, b) < TOL


def training_inputs(seed=0):
    """The pretraining forward's inputs: permutation ranks, target positions (one a padding row),
    segments, labels."""
    g = torch.Generator().manual_seed(seed)
    q_rank = torch.randint(0, L, (B, L), generator=g, dtype=torch.int32)
    target_pos = torch.tensor([[1, 5, 17, 12], [0, 9, 19, -1]])
    return {k: v.to(DEVICE) for k, v in dict(
        q_rank=q_rank, k_rank=q_rank - 1, target_pos=target_pos, token_type_ids=TOKEN_TYPES,
        labels=torch.randint(9, 50, (B, 4), generator=g)).items()}


def grads_of(model, x, **kw):
    model.zero_grad()
    out = model(x, **kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_xlnet_two_stream_training_step_on_triton():
    """Both streams in one launch with ranks, segments, bi_data and mems: loss and every gradient."""
    eager, fused = pair(bi_data=True)
    kw = training_inputs()
    with torch.no_grad():
        mems = eager(ids(1), token_type_ids=TOKEN_TYPES).mems
        no_segments = {k: v for k, v in kw.items() if k != "token_type_ids"}
        assert_visible("the segments", eager(ids(2), mems=mems, **no_segments).logits,
                       eager(ids(2), mems=mems, **kw).logits, TOL)
    a, ga = grads_of(eager, ids(2), mems=mems, **kw)
    with OpCalls() as ops:
        b, gb = grads_of(fused, ids(2), mems=mems, **kw)
    assert ops.backends() == {"triton"} and ops.count("rel_attention_backward") == fused.config.n_layer
    assert rel_err(b.logits, a.logits) < TOL and rel_err(b.loss, a.loss) < TOL
    assert ga.keys() == gb.keys()
    for n in ga:
        assert rel_err(gb[n], ga[n]) < GRAD_TOL, n


def test_xlnet_query_stream_in_its_own_launch_on_triton():
    """A soft target_mapping runs the query stream on every position, mapped in and out; one-hot
    targets with output_attentions run it on the target rows in a launch of its own (q_pos)."""
    eager, fused = pair(clamp_len=6, n_layer=1)  # one layer: the interpreter's backward is the cost
    soft = torch.rand(B, 3, L, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    one_hot = torch.zeros(B, 2, L, device=DEVICE)
    one_hot[:, 0, 3] = one_hot[:, 1, 15] = 1
    perm = (torch.rand(B, L, L, generator=torch.Generator().manual_seed(3)) > 0.5).float().to(DEVICE)
    perm[:, :, 0] = 0  # no fully blocked query row
    for kw in (dict(target_mapping=soft, token_type_ids=TOKEN_TYPES, labels=token_ids(B, 3, 4).to(DEVICE)),
               dict(target_mapping=one_hot, perm_mask=perm, output_attentions=True,
                    labels=token_ids(B, 2, 5).to(DEVICE))):
        with torch.no_grad():
            assert_visible("the positions", without_positions(eager)(ids(3), **kw).logits,
                           eager(ids(3), **kw).logits, TOL)
        a, ga = grads_of(eager, ids(3), **kw)
        with OpCalls() as ops:
            b, gb = grads_of(fused, ids(3), **kw)
        assert ops.backends() == {"triton"} and ops.count() == 2 * fused.config.n_layer  # content, query
        assert rel_err(b.logits, a.logits) < TOL
        for n in ga:
            assert rel_err(gb[n], ga[n]) < GRAD_TOL, n
        if kw.get("output_attentions"):
            for (ph, pg), (qh, qg) in zip(b.attentions, a.attentions, strict=True):
                assert rel_err(ph, qh) < TOL and rel_err(pg, qg) < TOL


# ---------------------------------------------------------------------------------------------------
# Transformer-XL
# ---------------------------------------------------------------------------------------------------


def txl_pair(fields):
    """(eager, triton) Transformer-XL LMs with 4.x-layout weights at SCALE, and the config dict."""
    c = hf4_config(**fields)
    state = layout_state(c, seed=2, std=SCALE)
    models = []
    for backend in ("eager", "triton"):
        model = TransfoXLLMHeadModel(TransfoXLConfig(**c, attn_backend=backend))
        model.load_hf_state_dict(state)
        models.append(model.eval().to(DEVICE))
    return models, c, state


def txl_segments(model, n=3, length=5):
    """Each segment's output (per-token losses, mems) over ``n`` segments carried by memory."""
    mems, outs = None, []
    for seg in range(n):
        x = torch.randint(0, model.config.vocab_size, (B, length), generator=torch.Generator().manual_seed(seg))
        out = model(x.to(DEVICE), mems=mems, labels=x.to(DEVICE))
        outs.append(out)
        mems = out.mems
    return outs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transfo_xl_configs_on_triton(name):
    """div_val 2 with clamp_len; same_length with pre_lnorm and a projected input; shared biases with
    same_length and clamp_len: three segments carried by memory, and the gradients."""
    (eager, fused), c, state = txl_pair(CONFIGS[name])
    with torch.no_grad():
        expected = txl_segments(eager)[-1].losses
        assert_visible("the positions", txl_segments(without_positions(eager))[-1].losses, expected, TOL)
        for option, default in (("clamp_len", -1), ("same_length", False), ("pre_lnorm", False)):
            if c[option] != default:
                other = TransfoXLLMHeadModel(TransfoXLConfig(**{**c, option: default}, attn_backend="eager"))
                other.load_hf_state_dict(state)
                assert_visible(option, txl_segments(other.eval().to(DEVICE))[-1].losses, expected, TOL)
    outs = {}
    for backend, model in (("eager", eager), ("triton", fused)):
        model.zero_grad()
        with OpCalls() as ops:
            segments = txl_segments(model)
            segments[-1].loss.backward()
        assert ops.backends() == {backend}
        outs[backend] = segments, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    (a, ga), (b, gb) = outs["eager"], outs["triton"]
    for x, y in zip(b, a, strict=True):
        assert rel_err(x.losses, y.losses) < TOL
        for m, n in zip(x.mems, y.mems, strict=True):
            assert rel_err(m, n) < TOL
    for n in ga:
        assert rel_err(gb[n], ga[n]) < GRAD_TOL, n


@pytest.mark.parametrize("fields", [dict(mem_len=4, same_length=True, clamp_len=3),
                                    dict(mem_len=12, pre_lnorm=True, div_val=2, d_embed=16)])
def test_transfo_xl_generation_on_triton(fields):
    """Greedy generation with the cached keys and values: the same tokens as the eager backend."""
    (eager, fused), _, _ = txl_pair(dict(CONFIGS["same_length_pre_lnorm"], **fields))
    x = torch.randint(0, eager.config.vocab_size, (B, 4), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    expected = eager.generate(x, max_new_tokens=8, eos_token_id=None)
    assert not torch.equal(without_positions(eager).generate(x, max_new_tokens=8, eos_token_id=None), expected)
    with OpCalls() as ops:
        out = fused.generate(x, max_new_tokens=8, eos_token_id=None)
    assert ops.backends() == {"triton"} and ops.count() >= 8 * fused.config.n_layer
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------------------------
# The op's claims
# ---------------------------------------------------------------------------------------------------


def saved_by(fn):
    """``fn()``'s result and the tensors autograd keeps for its backward."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, saved


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_the_op_keeps_o_of_l_for_backward(backend):
    """The forward keeps its inputs, ``out`` and the row log-sum-exp (and the Triton backend its mask
    tables, O(L)), nothing of size M x K (docs/DESIGN.md §4); a model's training forward keeps no
    tensor with two sequence-long dims."""
    case = make_case(B=2, M=40, qlen=40, H=2, D=8, mlen=24, mask="rank", self_visible=False,
                     q_pos=torch.randint(-1, 40, (2, 40), generator=torch.Generator().manual_seed(0)),
                     dtype=torch.float32).to(device=DEVICE)
    leaves = [t.detach().clone().requires_grad_() for t in case.args()]
    out, saved = saved_by(lambda: rel_attention(*leaves, **case.kwargs(), backend=backend))
    B, M, H, D = out.shape
    inputs = {t.data_ptr() for t in leaves} | {t.data_ptr() for t in case.kwargs().values()
                                                if isinstance(t, torch.Tensor)}
    new = [t for t in saved if t.data_ptr() not in inputs]
    floats = [tuple(t.shape) for t in new if t.is_floating_point()]
    assert sorted(floats) == sorted([(B, M, H, D), (B, H, M)]), floats  # out and lse
    # and, on the Triton backend, the masks' tables it built (ROWS, KEYS): int32, O(L) per batch row
    K = case.k.shape[1]
    tables = [t for t in new if not t.is_floating_point()]
    assert all(t.dtype == torch.int32 and t.numel() <= B * 4 * max(M, 128 * -(-K // 128)) for t in tables), \
        [(t.dtype, tuple(t.shape)) for t in tables]
    assert any(t.data_ptr() == out.data_ptr() for t in saved)

    eager, fused = pair(n_layer=1, d_model=32, d_inner=48)  # every width below L = 64
    model = {"eager": eager, "triton": fused}[backend].train()
    kw = training_inputs()
    length = 64
    g = torch.Generator().manual_seed(1)
    q_rank = torch.randint(0, length, (B, length), generator=g, dtype=torch.int32).to(DEVICE)
    kw.update(q_rank=q_rank, k_rank=q_rank - 1, token_type_ids=torch.zeros(B, length, dtype=torch.long, device=DEVICE))
    _, saved = saved_by(lambda: model(token_ids(B, length, 3).to(DEVICE), **kw).loss)
    square = [tuple(t.shape) for t in saved if sum(s >= length for s in t.shape) >= 2]
    assert not square, square


@pytest.mark.parametrize("what", ["float64_model", "float64_op", "head_dim_160"])
def test_forced_triton_never_falls_back_under_the_interpreter(what):
    """A forced backend raises for input the kernels do not take, before any launch (in Triton's
    interpreter too, where a CPU tensor is otherwise fine for them), instead of running eagerly."""
    with OpCalls() as ops, pytest.raises(ValueError, match="Triton backend supports"):
        if what == "float64_model":
            model = pair(n_layer=1)[1].double()
            model(ids(0))
        elif what == "float64_op":
            make_case(dtype=F64).to(device=DEVICE).call(rel_attention, backend="triton")
        else:
            make_case(B=1, M=4, H=1, D=160, mlen=1, dtype=torch.float32).to(device=DEVICE).call(
                rel_attention, backend="triton")
    assert ops.count() == 0, ops.calls  # nothing ran, on either backend


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_triton_dropout_keep_rate_and_expectation(p):
    """With uniform attention (q = k = k_r = 0) over values v = the identity, each output element is
    keep / K / (1 - rate): the drop rate is the documented ``round(256 p) / 256`` and the output's
    mean is that without dropout (1 / K), each within 5 sigma of a binomial."""
    from xlnet_fast.kernels import dropout_threshold

    Bd, H, K = 2, 2, 64
    zeros = torch.zeros(Bd, K, H, K, device=DEVICE)
    eye = torch.eye(K, device=DEVICE)[None, :, None, :].expand(Bd, K, H, K).contiguous()
    bias = torch.zeros(H, K, device=DEVICE)
    torch.manual_seed(11)
    out = rel_attention(zeros, zeros, eye, torch.zeros(1, 2 * K, H, K, device=DEVICE), bias, bias, dropout_p=p,
                        backend="triton")
    rate = dropout_threshold(p) / 256
    kept = out * K * (1 - rate)  # 1 where kept, 0 where dropped
    assert torch.allclose(kept, kept.round(), atol=1e-4), "an element is neither kept nor dropped"
    n = kept.numel()
    sigma = (rate * (1 - rate) / n) ** 0.5
    assert abs((1 - kept.mean().item()) - rate) < 5 * sigma
    assert abs(out.mean().item() * K - 1) < 5 * sigma / (1 - rate)  # the expectation is kept
