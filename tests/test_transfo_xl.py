"""Transformer-XL against float64 references written from the paper and the original code (the
relative term through the original zero-pad shift, the adaptive softmax per token), on weights in
transformers 4.x's layout that the tests write themselves; mems over several segments,
``same_length``, ``clamp_len``, ``pre_lnorm``, shared biases; gradients; loading and saving 4.x
directories; bad input."""

import json
import os

import pytest
import torch
from helpers.compare import rel_err
from helpers.transfo_xl import (CONFIGS, SMALL, hf4_config, layout_state, reference_forward, reference_log_probs,
                                reference_nll, tied_names, write_hf4_dir)
from hypothesis import given, settings
from hypothesis import strategies as st

import xlnet_fast
from xlnet_fast import TransfoXLConfig, TransfoXLLMHeadModel, TransfoXLModel
from xlnet_fast.transfo_xl.adaptive import ProjectedAdaptiveLogSoftmax

TOL = 1e-5  # fp32 model against the float64 reference (relative, whole tensors)
B, L = 2, 6


def ids(seed, batch=B, length=L, vocab=SMALL["vocab_size"]):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def labels_with_ignored(x):
    y = x.clone()
    y[0, 2] = -100
    return y


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf4_dir(request, tmp_path_factory):
    """(name, directory, config dict, state) of a 4.x-layout directory, safetensors except for the
    shared biases (4.46 writes those as pytorch_model.bin)."""
    name = request.param
    fmt = "bin" if not CONFIGS[name]["untie_r"] else "safetensors"
    path = tmp_path_factory.mktemp(name)
    c, state = write_hf4_dir(path, CONFIGS[name], seed=1, fmt=fmt)
    return name, str(path), c, state


def test_three_segments_with_mems_match_the_float64_reference(hf4_dir):
    name, path, c, state = hf4_dir
    model = TransfoXLLMHeadModel.from_pretrained(path, attn_backend="eager")
    ref_mems = mems = None
    for seg in range(3):
        x = ids(10 + seg)
        with torch.no_grad():
            out = model(x, mems=mems)
            lab = model(x, mems=mems, labels=labels_with_ignored(x))
        hidden, ref_mems_next, _ = reference_forward(c, state, x, ref_mems)
        ref_lp = reference_log_probs(c, state, hidden.reshape(-1, c["d_model"])).view(B, L, -1)
        target = labels_with_ignored(x)[:, 1:].reshape(-1)
        ref_losses = reference_nll(c, state, hidden[:, :-1].reshape(-1, c["d_model"]), target).view(B, L - 1)
        assert rel_err(out.prediction_scores, ref_lp) < TOL, (name, seg)
        assert rel_err(lab.losses, ref_losses) < TOL, (name, seg)
        assert lab.losses[0, 1] == 0  # label -100
        assert abs(float(lab.loss) - float(ref_losses.sum() / (target != -100).sum())) < 1e-5
        for m, r in zip(out.mems, ref_mems_next):
            assert m.shape == r.shape == (c["mem_len"], B, c["d_model"])
            assert rel_err(m, r) < TOL
        mems, ref_mems = out.mems, ref_mems_next


def test_attentions_and_hidden_states_match_the_reference(hf4_dir):
    _, path, c, state = hf4_dir
    model = TransfoXLLMHeadModel.from_pretrained(path, attn_backend="eager")
    x = ids(3)
    mems = [torch.randn(4, B, c["d_model"]) for _ in range(c["n_layer"])]
    with torch.no_grad():
        out = model.transformer(x, mems=mems, output_attentions=True, output_hidden_states=True)
    hidden, _, probs = reference_forward(c, state, x, [m.double() for m in mems])
    assert rel_err(out.last_hidden_state, hidden) < TOL
    assert len(out.hidden_states) == c["n_layer"] + 1 and rel_err(out.hidden_states[-1], hidden) < TOL
    for ours, ref in zip(out.attentions, probs):
        assert ours.shape == (B, c["n_head"], L, 4 + L)
        assert rel_err(ours, ref) < TOL


@settings(max_examples=12, deadline=None)
@given(qlen=st.integers(1, 5), mlen=st.integers(0, 6), mem_len=st.integers(1, 7), same_length=st.booleans(),
       clamp_len=st.integers(-1, 4), pre_lnorm=st.booleans())
def test_same_length_clamp_len_and_memory_lengths(qlen, mlen, mem_len, same_length, clamp_len, pre_lnorm):
    fields = dict(SMALL, n_layer=1, mem_len=mem_len, same_length=same_length, clamp_len=clamp_len,
                  pre_lnorm=pre_lnorm)
    c = hf4_config(**fields)
    state = layout_state(c, seed=qlen * 31 + mlen)
    model = TransfoXLModel(TransfoXLConfig(**c, attn_backend="eager")).eval()
    model.load_hf_state_dict(state)
    x = ids(qlen + 7 * mlen, batch=1, length=qlen)
    mems = [torch.randn(mlen, 1, c["d_model"], generator=torch.Generator().manual_seed(mlen))]
    with torch.no_grad():
        out = model(x, mems=mems)
    hidden, ref_mems, _ = reference_forward(c, state, x, [m.double() for m in mems])
    assert rel_err(out.last_hidden_state, hidden) < TOL
    assert out.mems[0].shape == ref_mems[0].shape and rel_err(out.mems[0], ref_mems[0]) < TOL


def test_gradients_match_the_float64_reference():
    c = hf4_config(**CONFIGS["div_val_2"])
    state = layout_state(c, seed=4)
    model = TransfoXLLMHeadModel(TransfoXLConfig(**c, attn_backend="eager")).double()
    d = c["d_model"]  # the frequencies in float64 too (4.x's files hold them in float32)
    exact = {"transformer.pos_emb.inv_freq": 1 / (10000 ** (torch.arange(0.0, d, 2.0, dtype=torch.float64) / d))}
    model.load_hf_state_dict({**{k: v.double() for k, v in state.items()}, **exact})
    x = ids(5)
    mems = [torch.randn(3, B, c["d_model"], dtype=torch.float64) for _ in range(c["n_layer"])]
    model(x, mems=mems, labels=x).loss.backward()
    params = {n: p for n, p in model.named_parameters()}
    ref_state = {k: v.double().clone().requires_grad_(v.is_floating_point() and "inv_freq" not in k)
                 for k, v in state.items()}
    for name, source in tied_names(c).items():
        ref_state[name] = ref_state[source]
    hidden, _, _ = reference_forward(c, ref_state, x, mems)
    nll = reference_nll(c, ref_state, hidden[:, :-1].reshape(-1, c["d_model"]), x[:, 1:].reshape(-1))
    nll.mean().backward()
    for name in ("transformer.layers.0.dec_attn.qkv_net.weight", "transformer.layers.1.dec_attn.r_r_bias",
                 "transformer.layers.0.dec_attn.r_w_bias", "transformer.layers.1.dec_attn.r_net.weight",
                 "transformer.word_emb.emb_projs.1", "crit.cluster_weight", "crit.out_layers.2.bias"):
        assert rel_err(params[name].grad, ref_state[name].grad) < 1e-9, name


@pytest.mark.parametrize("cutoffs, div_val, d_embed",
                         [([20, 45], 1, 16), ([20, 45], 2, 16), ([], 1, 12), ([30], 1, 12)])
def test_adaptive_softmax_against_the_reference(cutoffs, div_val, d_embed):
    c = hf4_config(**dict(SMALL, cutoffs=cutoffs, div_val=div_val, d_embed=d_embed))
    state = layout_state(c, seed=2)
    crit = ProjectedAdaptiveLogSoftmax(c["vocab_size"], d_embed, c["d_model"], cutoffs, div_val).double()
    crit.load_state_dict({k[5:]: v.double() for k, v in state.items() if k.startswith("crit.")}, strict=True)
    hidden = torch.randn(9, c["d_model"], dtype=torch.float64)
    lp = crit.log_probs(hidden)
    assert rel_err(lp, reference_log_probs(c, state, hidden)) < 1e-12
    assert torch.allclose(lp.logsumexp(-1), torch.zeros(9, dtype=torch.float64), atol=1e-12)
    target = torch.tensor([0, 19, 20, 44, 45, 59, -100, 3, 50])
    assert rel_err(crit.nll(hidden, target), reference_nll(c, state, hidden, target)) < 1e-12
    hidden.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h: crit.nll(h, target), (hidden,))


def test_round_trip_keeps_4x_names_and_config(hf4_dir, tmp_path):
    name, path, c, state = hf4_dir
    model = TransfoXLLMHeadModel.from_pretrained(path)
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == set(state) - set(tied_names(c))  # what 4.x writes (shared r biases under every name)
    for k, v in saved.items():
        assert torch.equal(v, state[k].float()), k
    written = json.loads((tmp_path / "config.json").read_text())
    for key in ("model_type", "cutoffs", "tie_projs", "div_val", "d_embed", "untie_r", "same_length", "pre_lnorm",
                "clamp_len", "mem_len", "trainer_compatible"):
        assert written[key] == c[key], key
    again = TransfoXLLMHeadModel.from_pretrained(tmp_path)
    x = ids(8)
    with torch.no_grad():
        assert torch.equal(again(x).prediction_scores, model(x).prediction_scores)


def test_backbone_and_head_load_each_others_directories(tmp_path):
    _, state = write_hf4_dir(tmp_path / "lm", CONFIGS["div_val_2"])
    backbone = TransfoXLModel.from_pretrained(tmp_path / "lm")
    assert torch.equal(backbone.layers[1].dec_attn.r_net.weight, state["transformer.layers.1.dec_attn.r_net.weight"])
    backbone.save_pretrained(tmp_path / "backbone")
    lm = TransfoXLLMHeadModel.from_pretrained(tmp_path / "backbone")
    assert torch.equal(lm.transformer.word_emb.emb_projs[2], state["transformer.word_emb.emb_projs.2"])


def test_tied_weights_are_one_parameter():
    model = TransfoXLLMHeadModel(TransfoXLConfig(**dict(SMALL, div_val=2, d_embed=16)))
    for i in range(3):
        assert model.crit.out_layers[i].weight is model.transformer.word_emb.emb_layers[i].weight
    assert model.crit.out_projs[1] is model.transformer.word_emb.emb_projs[1]
    assert model.crit.out_projs[0] is not model.transformer.word_emb.emb_projs[0]  # tie_projs[0] is False
    shared = TransfoXLModel(TransfoXLConfig(**dict(SMALL, untie_r=False)))
    assert all(layer.dec_attn.r_w_bias is shared.r_w_bias for layer in shared.layers)


def test_4x_calling_conventions():
    model = TransfoXLLMHeadModel(TransfoXLConfig(**SMALL)).eval()
    x = ids(1)
    with torch.no_grad():
        out = model(x)
        assert out.logits is out.prediction_scores and out.prediction_scores.shape == (B, L, SMALL["vocab_size"])
        assert len(out.mems) == SMALL["n_layer"] and out.mems[0].shape == (SMALL["mem_len"], B, SMALL["d_model"])
        scores, mems = model(x, return_dict=False)
        assert torch.equal(scores, out.prediction_scores)
        losses, empty, mems2, loss = model(x, labels=x, return_dict=False)
        assert losses.shape == (B, L - 1) and empty == () and loss.dim() == 0
        assert model(x, logits_to_keep=1).prediction_scores.shape == (B, 1, SMALL["vocab_size"])
        assert model.init_mems(B, length=0)[0].shape == (0, B, SMALL["d_model"])
        assert model(x, mems=model.init_mems(B, length=0)).mems[0].shape == (SMALL["mem_len"], B, SMALL["d_model"])


def test_triton_kernels_match_eager():
    """The fused kernels (Triton's interpreter on a CPU) on causal ranks and the same_length mask."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = dict(SMALL, n_layer=1, same_length=True)
    eager = TransfoXLLMHeadModel(TransfoXLConfig(**c, attn_backend="eager")).eval().to(device)
    fused = TransfoXLLMHeadModel(TransfoXLConfig(**c, attn_backend="triton")).eval().to(device)
    fused.load_state_dict(eager.state_dict())
    x = ids(2, length=4).to(device)
    with torch.no_grad():
        a, b = eager(x), fused(x)
        a2, b2 = eager(x, mems=a.mems), fused(x, mems=b.mems)
    assert rel_err(b.prediction_scores, a.prediction_scores) < 1e-5
    assert rel_err(b2.prediction_scores, a2.prediction_scores) < 1e-5


BAD_CONFIGS = [
    (dict(cutoffs=[30, 20]), "cutoffs must be increasing"),
    (dict(cutoffs=[20, 60]), r"cutoffs must be increasing integers in \(0, vocab_size=60\)"),
    (dict(cutoffs=[0, 20]), "cutoffs must be"),
    (dict(div_val=4, d_embed=8), "no dimension for the last"),
    (dict(mem_len=0, same_length=True), "same_length=True .* needs mem_len > 0"),
    (dict(mem_len=-1), "mem_len must be >= 0"),
    (dict(attn_backend="cuda"), "attn_backend must be one of"),
    (dict(attn_type=1), "attn_type must be 0"),
]


@pytest.mark.parametrize("fields, message", BAD_CONFIGS)
def test_bad_configs_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        TransfoXLConfig(**{**SMALL, **fields})


def test_bad_inputs_are_named_before_any_compute():
    model = TransfoXLLMHeadModel(TransfoXLConfig(**SMALL)).eval()
    x = ids(1)
    good_mems = model.init_mems(B)
    cases = [
        (dict(input_ids=x + 100), ValueError, r"input_ids must be in \[0, vocab_size=60\)"),
        (dict(input_ids=x.float()), TypeError, "input_ids must be an integer tensor"),
        (dict(input_ids=x, mems=good_mems[:1]), ValueError, r"mems must hold one tensor per layer \(2\), got 1"),
        (dict(input_ids=x, mems=[m[:, :1] for m in good_mems]), ValueError, r"mems\[0\] must be \(mlen, batch=2"),
        (dict(input_ids=x, mems=[good_mems[0], good_mems[1][:2]]), ValueError, r"mems\[1\] has mlen 2"),
        (dict(input_ids=x, labels=x + 100), ValueError, r"labels must be in \[0, vocab_size=60\) or -100"),
        (dict(input_ids=x, labels=x[:, :3]), ValueError, "labels must have the shape of input_ids"),
        (dict(input_ids=x, head_mask=torch.ones(2)), ValueError, "head_mask is not supported"),
        (dict(input_ids=x, logits_to_keep=-1), ValueError, "logits_to_keep must be an integer >= 0"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            model(**kwargs)


def test_loading_other_directories_is_a_clear_error(tmp_path):
    xl = xlnet_fast.XLNetLMHeadModel(xlnet_fast.XLNetConfig(vocab_size=20, d_model=8, n_layer=1, n_head=2, d_inner=8))
    xl.save_pretrained(tmp_path / "xlnet")
    with pytest.raises(ValueError, match="describes a 'xlnet' model, not 'transfo-xl'"):
        TransfoXLLMHeadModel.from_pretrained(tmp_path / "xlnet")
    write_hf4_dir(tmp_path / "txl", SMALL)
    with pytest.raises(ValueError, match="describes a 'transfo-xl' model, not 'xlnet'"):
        xlnet_fast.XLNetLMHeadModel.from_pretrained(tmp_path / "txl")
    state = os.path.join(tmp_path, "txl", "model.safetensors")
    with open(state, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="truncated or corrupted"):
        TransfoXLLMHeadModel.from_pretrained(tmp_path / "txl")
    with pytest.raises(TypeError, match="no TransfoXLConfig field"):
        TransfoXLLMHeadModel.from_pretrained(tmp_path / "txl", not_a_field=1)
