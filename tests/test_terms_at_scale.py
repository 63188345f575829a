"""Our XLNet against transformers', and our Transformer-XL against its float64 reference, at a weight
scale where every term of the attention matters (``helpers.models.SCALE``; at transformers' default
init a removed clamp or a wrong segment for the memory keys moved the outputs by ~1e-5, under the
parity tolerance). Each test first shows that the term it checks — the positions, ``clamp_len``,
``bi_data``, causal attention and ``same_length``, the segments, the memory's segment, the memory, the
content stream's own key, ``pre_lnorm`` — changes the reference's outputs by at least ``SEEN`` times
its tolerance, then compares outputs, new mems and gradients."""

import pytest
import torch
from helpers.compare import rel_err
from helpers.models import SCALE, SEEN, assert_visible, scaled_hf_model, scaled_twins, token_ids, without_positions
from helpers.transfo_xl import CONFIGS as TXL_CONFIGS
from helpers.transfo_xl import hf4_config, layout_state, reference_forward

from xlnet_fast import TransfoXLConfig, TransfoXLModel

TOL = 1e-4  # the parity tolerance of tests/test_model_parity.py, outputs and mems
GRAD_TOL = 1e-3  # and of its gradients
TXL_TOL = 1e-5  # tests/test_transfo_xl.py's: fp32 Transformer-XL against the float64 reference
B, L = 2, 7
# segment ids: two segments, the <cls> segment 2, a row that starts in segment 1
TOKEN_TYPES = torch.tensor([[0, 0, 0, 1, 1, 1, 2], [1, 1, 1, 1, 0, 0, 2]])


def ids(seed, batch=B, length=L):
    return token_ids(batch, length, seed)


def two_calls(model, token_type_ids=None, **kw):
    """Logits of a first call and of a second one over its mems (mlen = mem_len), and those mems."""
    first = model(ids(1), token_type_ids=token_type_ids, **kw)
    second = model(ids(2), mems=first.mems, token_type_ids=token_type_ids, **kw)
    return first.logits, second.logits, second.mems


def assert_two_calls_match(ours, hf, **kw):
    with torch.no_grad():
        a1, a2, a_mems = two_calls(hf, **kw)
        b1, b2, b_mems = two_calls(ours, **kw)
    assert rel_err(b1, a1) < TOL, rel_err(b1, a1)
    assert rel_err(b2, a2) < TOL, rel_err(b2, a2)
    for m_ours, m_hf in zip(b_mems, a_mems, strict=True):
        assert rel_err(m_ours, m_hf) < TOL


# each configuration with the term it adds: (overrides, the model without the term)
POSITION_TERMS = {
    "positions": ({}, None),
    "clamp_len": ({"clamp_len": 2}, {}),
    "bi_data": ({"bi_data": True}, {}),
    "bi_data_clamp_len": ({"bi_data": True, "clamp_len": 2}, {"bi_data": True}),
    "uni": ({"attn_type": "uni"}, {}),
    "uni_same_length": ({"attn_type": "uni", "same_length": True}, {"attn_type": "uni"}),
}


@pytest.mark.parametrize("name", sorted(POSITION_TERMS))
def test_position_terms_over_two_calls_with_mems(name):
    overrides, without = POSITION_TERMS[name]
    hf, ours = scaled_twins("XLNetLMHeadModel", **overrides)
    with torch.no_grad():
        expected = two_calls(hf, token_type_ids=TOKEN_TYPES)[1]
        assert_visible("the position term", two_calls(without_positions(hf), token_type_ids=TOKEN_TYPES)[1],
                       expected, TOL)
        if without is not None:  # the same weights (same seed), without the option
            other = scaled_hf_model("XLNetLMHeadModel", **without)
            assert_visible(name, two_calls(other, token_type_ids=TOKEN_TYPES)[1], expected, TOL)
    assert_two_calls_match(ours, hf, token_type_ids=TOKEN_TYPES)


def test_segments_and_the_memorys_segment():
    """The memory's keys are segment 0: with the current tokens all in segment 1 they are of another
    segment, all in segment 0 of the same one; both, and mixed segments, match transformers."""
    hf, ours = scaled_twins("XLNetLMHeadModel")
    ones, zeros = torch.ones_like(TOKEN_TYPES), torch.zeros_like(TOKEN_TYPES)
    with torch.no_grad():
        mixed = two_calls(hf, token_type_ids=TOKEN_TYPES)[1]
        assert_visible("the segment term", two_calls(hf)[1], mixed, TOL)
        all_ones = two_calls(hf, token_type_ids=ones)[1]
        # the current keys are of the query's segment either way: only the memory's segment differs
        assert_visible("the memory keys' segment", two_calls(hf, token_type_ids=zeros)[1], all_ones, TOL)
    for token_type_ids in (TOKEN_TYPES, ones, zeros):
        assert_two_calls_match(ours, hf, token_type_ids=token_type_ids)


def test_memory_and_reuse_len():
    hf, ours = scaled_twins("XLNetLMHeadModel", reuse_len=4)
    with torch.no_grad():
        with_mems = two_calls(hf, token_type_ids=TOKEN_TYPES)[1]
        assert_visible("the memory", hf(ids(2), token_type_ids=TOKEN_TYPES).logits, with_mems, TOL)
    assert_two_calls_match(ours, hf, token_type_ids=TOKEN_TYPES)


def random_perm_mask(seed=4):
    """Random dense perm_mask, key 0 visible to every row (transformers averages a row that sees
    nothing; we give zeros there, docs/DESIGN.md §2)."""
    mask = (torch.rand(B, L, L, generator=torch.Generator().manual_seed(seed)) > 0.5).float()
    mask[:, :, 0] = 0
    return mask


def one_hot_targets(positions):
    tm = torch.zeros(B, len(positions), L)
    for p, t in enumerate(positions):
        tm[:, p, t] = 1.0
    return tm


@pytest.mark.parametrize("targets", ["one_hot", "soft"])
def test_two_stream_with_perm_mask_mems_and_gradients(targets):
    """Both streams with a dense perm_mask, segments and mems, a one-hot target_mapping (one launch
    for both streams) or a soft one (the query stream on every position, mapped in and out)."""
    hf, ours = scaled_twins("XLNetLMHeadModel")
    tm = one_hot_targets([1, 4, 6]) if targets == "one_hot" else \
        torch.rand(B, 3, L, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        mems = hf(ids(1), token_type_ids=TOKEN_TYPES).mems
    kw = dict(perm_mask=random_perm_mask(), target_mapping=tm, token_type_ids=TOKEN_TYPES, mems=mems,
              labels=token_ids(B, 3, 5))
    with torch.no_grad():
        probs = hf.transformer(ids(3), **{k: v for k, v in kw.items() if k != "labels"}, output_attentions=True)
        own = probs.attentions[-1][0].diagonal(offset=mems[0].shape[0], dim1=-2, dim2=-1)  # (B, H, L)
        # the content stream's own key carries this share of each row's attention on average: a
        # content row that lost it (self_visible dropped) would change by about as much
        assert own.mean() > SEEN * TOL, own.mean()
        assert_visible("the query stream's positions", without_positions(hf)(ids(3), **kw).logits,
                       hf(ids(3), **kw).logits, TOL)
    a, b = hf(ids(3), **kw), ours(ids(3), **kw)
    assert rel_err(b.logits, a.logits) < TOL and rel_err(b.loss, a.loss) < TOL
    a.loss.backward()
    b.loss.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, hf_params[name].grad) < GRAD_TOL, name


def test_content_stream_with_perm_mask_and_attentions():
    """No target_mapping: the content stream alone under a dense perm_mask; with output_attentions
    the probabilities too (the layer's second, eager computation of them)."""
    hf, ours = scaled_twins("XLNetModel")
    kw = dict(perm_mask=random_perm_mask(6), token_type_ids=TOKEN_TYPES, output_attentions=True)
    with torch.no_grad():
        a, b = hf(ids(4), **kw), ours(ids(4), **kw)
        assert_visible("the perm_mask", hf(ids(4), token_type_ids=TOKEN_TYPES).last_hidden_state,
                       a.last_hidden_state, TOL)
    assert rel_err(b.last_hidden_state, a.last_hidden_state) < TOL
    for x, y in zip(b.attentions, a.attentions, strict=True):
        assert rel_err(x, y) < TOL


# ---------------------------------------------------------------------------------------------------
# Transformer-XL against its float64 reference (tests/helpers/transfo_xl.py)
# ---------------------------------------------------------------------------------------------------


def txl_hidden(model_or_config, state=None, n=2, length=5):
    """The last hidden state of the second of ``n`` segments carried by memory: of our fp32 model, or
    (a config dict and weights) of the float64 reference."""
    mems = None
    for seg in range(n):
        x = torch.randint(0, 60, (B, length), generator=torch.Generator().manual_seed(seg))
        if state is None:
            with torch.no_grad():
                out = model_or_config(x, mems=mems)
            hidden, mems = out.last_hidden_state, out.mems
        else:
            hidden, mems, _ = reference_forward(model_or_config, state, x, mems)
    return hidden


@pytest.mark.parametrize("name", sorted(TXL_CONFIGS))
def test_transfo_xl_terms_against_the_float64_reference(name):
    """div_val 2 with clamp_len; same_length with pre_lnorm; shared biases with same_length and
    clamp_len: each option, the positions and the memory move the reference's output far above the
    tolerance, and the model follows the reference."""
    c = hf4_config(**TXL_CONFIGS[name])
    state = layout_state(c, seed=3, std=SCALE)
    model = TransfoXLModel(TransfoXLConfig(**c, attn_backend="eager")).eval()
    model.load_hf_state_dict(state)
    expected = txl_hidden(c, state)
    no_positions = {k: torch.zeros_like(v) if k.endswith("r_net.weight") else v for k, v in state.items()}
    assert_visible("the positions", txl_hidden(c, no_positions), expected, TXL_TOL)
    assert_visible("the memory", txl_hidden(c, state, n=1), expected, TXL_TOL)
    for option, default in (("clamp_len", -1), ("same_length", False), ("pre_lnorm", False)):
        if c[option] != default:
            assert_visible(option, txl_hidden({**c, option: default}, state), expected, TXL_TOL)
    assert rel_err(txl_hidden(model), expected) < TXL_TOL
