"""The model's surface, the conventions users rely on: clear errors naming the argument, what
transformers accepts and ignores, edge cases that stay finite, loading in eval mode with config
overrides, broken checkpoint files reported by name."""

import logging

import pytest
import torch
import transformers
from helpers.compare import rel_err
from helpers.models import SMALL, token_ids, twins

import xlnet_fast
from xlnet_fast import XLNetConfig, XLNetLMHeadModel, XLNetModel

B, L = 2, 6


def ids(seed=0):
    return token_ids(B, L, seed)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return XLNetModel(XLNetConfig(**SMALL, attn_backend="eager")).eval()


@pytest.fixture(scope="module")
def lm_model():
    torch.manual_seed(0)
    return XLNetLMHeadModel(XLNetConfig(**SMALL, attn_backend="eager")).eval()


def ranks():
    q_rank = torch.tensor([[3, 0, 1, 4, 2, 5]] * B, dtype=torch.int32)
    return dict(q_rank=q_rank, k_rank=q_rank - 1)


# ---------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [dict(token_type_ids=torch.zeros(B, L, dtype=torch.long)), ranks(), {}])
def test_target_pos_past_the_sequence_is_a_value_error(model, extra):
    with pytest.raises(ValueError, match=r"target_pos values must be < seq_len = 6"):
        model(ids(), target_pos=torch.tensor([[1, L], [0, 2]]), **extra)


@pytest.mark.parametrize("mems", [lambda m: [None, m[1]], lambda m: [m[0], None]])
def test_mems_mixing_none_and_tensors_is_a_value_error(model, mems):
    with torch.no_grad():
        full = model(ids(), use_mems=True).mems
    with pytest.raises(ValueError, match=r"mems\[\d\] is None but other layers have memory"):
        model(ids(1), mems=mems(full))


def test_inputs_embeds_of_another_dtype_is_a_type_error(model):
    embeds = torch.randn(B, L, SMALL["d_model"], dtype=torch.float64)
    with pytest.raises(TypeError, match="inputs_embeds has dtype torch.float64 but the model's weights are"):
        model(inputs_embeds=embeds)


def test_unknown_keyword_is_a_type_error_naming_it(model):
    with pytest.raises(TypeError, match=r"unexpected keyword arguments: \['attn_mask'\]"):
        model(ids(), attn_mask=torch.ones(B, L))


BAD_INPUTS = [
    (dict(input_ids=torch.full((B, L), 50)), ValueError, r"input_ids must be in \[0, vocab_size=50\)"),
    (dict(input_ids=torch.full((B, L), -1)), ValueError, "input_ids must be in"),
    (dict(input_ids=torch.ones(B, L)), TypeError, "input_ids must be an integer tensor"),
    (dict(input_ids=torch.ones(B, L, 2, dtype=torch.long)), ValueError, "input_ids must be"),
    (dict(perm_mask=torch.zeros(B, L, L + 1)), ValueError, "perm_mask must have shape"),
    (dict(target_mapping=torch.zeros(B, 2, L + 1)), ValueError, "target_mapping must have shape"),
    (dict(token_type_ids=torch.zeros(B, L + 1, dtype=torch.long)), ValueError, "token_type_ids must have shape"),
    (dict(token_type_ids=torch.zeros(B, L)), TypeError, "token_type_ids must be an integer"),
    (dict(attention_mask=torch.ones(B + 1, L)), ValueError, "attention_mask must have shape"),
    (dict(attention_mask=torch.ones(B, L), input_mask=torch.zeros(B, L)), ValueError, "only one of"),
    (dict(mems=[torch.zeros(3, B, 32)]), ValueError, "one tensor per layer"),
    (dict(mems=[torch.zeros(3, B + 1, 32)] * 2), ValueError, r"mems\[0\] must be"),
    (dict(mems=[torch.zeros(3, B, 31)] * 2), ValueError, r"mems\[0\] must be"),
    (dict(mems=[torch.zeros(3, B, 32), torch.zeros(4, B, 32)]), ValueError, r"mems\[1\] has mlen"),
    (dict(attention_mask=torch.ones(B, L, device="meta")), ValueError, "attention_mask is on meta"),
    (dict(q_rank=torch.zeros(B, L, dtype=torch.int32)), ValueError, "given together"),
    # regression: int64 ranks past int32 were narrowed, wrapping into other ranks or the sentinels
    (dict(q_rank=torch.full((B, L), 2**31), k_rank=torch.zeros(B, L, dtype=torch.long)), ValueError,
     r"q_rank values must fit in int32 .*, got \[2147483648, 2147483648\]"),
    (dict(q_rank=torch.zeros(B, L, dtype=torch.long), k_rank=torch.full((B, L), -2**31 - 1)), ValueError,
     "k_rank values must fit in int32"),
    (dict(target_pos=torch.zeros(B, 2, dtype=torch.long), target_mapping=torch.zeros(B, 2, L)), ValueError,
     "either target_mapping or target_pos"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_INPUTS)
def test_model_rejects_bad_input_naming_the_argument(lm_model, kwargs, exc, match):
    kwargs = dict(kwargs)
    x = kwargs.pop("input_ids", ids())
    with pytest.raises(exc, match=match):
        lm_model(x, **kwargs)


def test_inputs_embeds_checked(lm_model):
    with pytest.raises(ValueError, match="inputs_embeds must be"):
        lm_model(inputs_embeds=torch.zeros(B, L, 7))
    with pytest.raises(ValueError, match="either input_ids or inputs_embeds"):
        lm_model()


# ---------------------------------------------------------------------------------------------
# What transformers accepts
# ---------------------------------------------------------------------------------------------


def test_mems_as_one_stacked_tensor_equal_a_list(model):
    with torch.no_grad():
        mems = model(ids(), use_mems=True).mems
        as_list = model(ids(1), mems=list(mems)).last_hidden_state
        stacked = model(ids(1), mems=torch.stack(mems)).last_hidden_state
    torch.testing.assert_close(stacked, as_list, rtol=0, atol=0)


def test_mems_are_a_tuple_like_transformers():
    hf, ours = twins("XLNetLMHeadModel")
    with torch.no_grad():
        a, b = hf(ids(), use_mems=True), ours(ids(), use_mems=True)
    assert type(b.mems) is type(a.mems) is tuple


def test_bool_target_mapping_equals_float(model):
    tm = torch.zeros(B, 2, L, dtype=torch.bool)
    tm[:, 0, 2] = tm[:, 1, 5] = True
    with torch.no_grad():
        as_bool = model(ids(), target_mapping=tm).last_hidden_state
        as_float = model(ids(), target_mapping=tm.float()).last_hidden_state
    torch.testing.assert_close(as_bool, as_float, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["XLNetModel", "XLNetForSequenceClassification", "XLNetLMHeadModel"])
def test_keywords_transformers_ignores_are_ignored(name):
    hf, ours = twins(name)
    ignored = dict(head_mask=torch.ones(SMALL["n_layer"], SMALL["n_head"]), position_ids=torch.arange(L)[None],
                   num_items_in_batch=4)
    if name != "XLNetLMHeadModel":
        ignored["logits_to_keep"] = 1  # the backbone ignores it; the LM head uses it (below)
    with torch.no_grad():
        plain = ours(ids())[0]
        ignoring = ours(ids(), **ignored)[0]
        reference = hf(ids(), **ignored)[0]
    torch.testing.assert_close(ignoring, plain, rtol=0, atol=0)
    assert rel_err(ignoring, reference) < 1e-5


@pytest.mark.parametrize("keep", [0, 1, 3, torch.tensor([0, 4]), torch.tensor([[1, 2], [5, 0]]),
                                  torch.tensor([[True, False, True, False, False, True]] * B)])
def test_logits_to_keep_like_transformers(keep):
    hf, ours = twins("XLNetLMHeadModel")
    labels_len = {0: L, 1: 1, 3: 3}.get(keep) if isinstance(keep, int) else None
    with torch.no_grad():
        a = hf(ids(), logits_to_keep=keep)
        b = ours(ids(), logits_to_keep=keep)
    assert b.logits.shape == a.logits.shape
    if labels_len is not None:
        assert b.logits.shape[1] == labels_len
    assert rel_err(b.logits, a.logits) < 1e-5


def test_logits_to_keep_rejects_other_types():
    _, ours = twins("XLNetLMHeadModel")
    with pytest.raises(TypeError, match="logits_to_keep must be an int or a tensor"):
        ours(ids(), logits_to_keep=1.5)
    with pytest.raises(ValueError, match="logits_to_keep must be"):
        ours(ids(), logits_to_keep=torch.ones(B, L, 2, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# target_pos with output_attentions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, ranks(), dict(perm_mask=(torch.rand(B, L, L, generator=torch.Generator().manual_seed(0)) > 0.5).float())])
def test_target_pos_with_output_attentions_returns_query_stream_probabilities(model, extra):
    """target_pos gives the query stream's (B, H, P, K) attentions: the rows of the general
    target_mapping path's (B, H, L, K) at the targets; outputs stay those of the fused path."""
    tt = torch.tensor([[0, 0, 0, 1, 1, 1]] * B)
    target_pos = torch.tensor([[4, 1], [2, -1]])  # -1: a padding row
    tm = torch.zeros(B, 2, L)
    tm[0, 0, 4] = tm[0, 1, 1] = tm[1, 0, 2] = 1
    with torch.no_grad():
        fused = model(ids(), target_pos=target_pos, token_type_ids=tt, **extra)
        out = model(ids(), target_pos=target_pos, token_type_ids=tt, output_attentions=True, **extra)
        general = model(ids(), target_mapping=tm, token_type_ids=tt, output_attentions=True, **extra)
    assert rel_err(out.last_hidden_state, fused.last_hidden_state) < 1e-6
    assert len(out.attentions) == SMALL["n_layer"]
    for (content, query), (content_ref, query_ref) in zip(out.attentions, general.attentions):
        assert query.shape == (B, SMALL["n_head"], 2, L)
        torch.testing.assert_close(content, content_ref)
        torch.testing.assert_close(query[0], query_ref[0][:, [4, 1]])
        torch.testing.assert_close(query[1, :, 0], query_ref[1, :, 2])
        assert torch.all(query[1, :, 1] == 0)  # the padding row


def test_target_pos_with_output_attentions_on_triton():
    torch.manual_seed(0)
    cfg = dict(SMALL, n_layer=1)
    eager = XLNetModel(XLNetConfig(**cfg, attn_backend="eager")).eval()
    triton = XLNetModel(XLNetConfig(**cfg, attn_backend="triton")).eval()
    triton.load_state_dict(eager.state_dict())
    kw = dict(target_pos=torch.tensor([[4, 1], [2, -1]]), output_attentions=True, **ranks())
    with torch.no_grad():
        a, b = eager(ids(), **kw), triton(ids(), **kw)
    assert rel_err(b.last_hidden_state, a.last_hidden_state) < 1e-5
    torch.testing.assert_close(b.attentions[0][1], a.attentions[0][1])


# ---------------------------------------------------------------------------------------------
# Edge cases stay finite
# ---------------------------------------------------------------------------------------------


def _finite(*tensors):
    return all(torch.isfinite(t).all() for t in tensors if t is not None)


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_no_nan_with_padding_rows_and_fully_blocked_targets(backend, dtype):
    torch.manual_seed(0)
    cfg = dict(SMALL, n_layer=1, d_model=32, n_head=2)
    m = XLNetLMHeadModel(XLNetConfig(**cfg, attn_backend=backend)).to(dtype)
    x = ids()
    am = torch.ones(B, L)
    am[1] = 0  # a batch row that is all padding
    # every token a target and the first in the order sees nothing: q_rank 0 blocks all keys
    q_rank = torch.arange(L, dtype=torch.int32).expand(B, L).contiguous()
    k_rank = q_rank.clone()
    target_pos = torch.arange(L).expand(B, L)
    out = m(x, attention_mask=am, q_rank=q_rank, k_rank=k_rank, target_pos=target_pos,
            labels=x, token_type_ids=torch.zeros(B, L, dtype=torch.long))
    out.loss.backward()
    assert _finite(out.logits.float(), out.loss)
    assert all(_finite(p.grad.float()) for p in m.parameters() if p.grad is not None)


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_training_step_under_autocast_with_float32_weights(backend):
    """Regression (first GPU run): pretraining's bf16 autocast with float32 weights raised "r_w_bias
    must have dtype in ['torch.bfloat16']" in both models; the loss under autocast stays close to the
    float32 one and every weight gets a finite float32 gradient."""
    torch.manual_seed(0)
    xlnet = XLNetLMHeadModel(XLNetConfig(**dict(SMALL, n_layer=1), attn_backend=backend))
    transfo_xl = xlnet_fast.TransfoXLLMHeadModel(xlnet_fast.TransfoXLConfig(
        vocab_size=50, cutoffs=[], d_model=32, d_embed=32, n_head=2, d_head=16, d_inner=64, n_layer=1, mem_len=4,
        attn_backend=backend))
    x = ids()
    target_pos = torch.tensor([[1, 4]] * B)
    calls = [(xlnet, dict(token_type_ids=(torch.arange(L) >= 3).long().expand(B, L), target_pos=target_pos,
                          labels=x.gather(1, target_pos), **ranks())),
             (transfo_xl, dict(labels=x))]
    for model, kwargs in calls:
        plain = model(x, **kwargs).loss
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, **kwargs).loss
        loss.backward()
        assert rel_err(loss.float(), plain) < 2e-2, type(model).__name__
        assert all(p.grad.dtype == torch.float32 and _finite(p.grad) for p in model.parameters() if p.grad is not None)


def test_long_sequence_eager_bf16_is_finite():
    torch.manual_seed(0)
    m = XLNetModel(XLNetConfig(**dict(SMALL, n_layer=1), attn_backend="eager")).to(torch.bfloat16)
    x = torch.randint(9, 50, (1, 1024))
    am = torch.ones(1, 1024)
    am[:, :300] = 0
    out = m(x, attention_mask=am).last_hidden_state
    out.float().square().mean().backward()
    assert _finite(out.float())


# ---------------------------------------------------------------------------------------------
# from_pretrained: eval mode, overrides, broken files named
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def classifier_dir(tmp_path):
    hf, _ = twins("XLNetForSequenceClassification", dropout=0.1, summary_last_dropout=0.1)
    hf.save_pretrained(tmp_path)
    return tmp_path


def test_from_pretrained_returns_eval_mode(classifier_dir):
    model = xlnet_fast.XLNetForSequenceClassification.from_pretrained(classifier_dir)
    reference = transformers.XLNetForSequenceClassification.from_pretrained(classifier_dir)
    assert model.training is reference.training is False
    with torch.no_grad():
        first, second = model(ids()).logits, model(ids()).logits
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert rel_err(first, reference(ids()).logits) < 1e-5


def test_from_pretrained_num_labels_override_like_transformers(classifier_dir):
    cls = xlnet_fast.XLNetForSequenceClassification
    with pytest.raises(ValueError, match="logits_proj.weight has shape .* ignore_mismatched_sizes"):
        cls.from_pretrained(classifier_dir, num_labels=3)
    model = cls.from_pretrained(classifier_dir, num_labels=3, ignore_mismatched_sizes=True)
    assert model.config.num_labels == 3 and model.config.id2label == {0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"}
    assert model(ids()).logits.shape == (B, 3)
    saved = transformers.XLNetForSequenceClassification.from_pretrained(classifier_dir)
    torch.testing.assert_close(model.transformer.layer[0].rel_attn.q, saved.transformer.layer[0].rel_attn.q)


def test_from_pretrained_label_and_config_overrides(classifier_dir):
    cls = xlnet_fast.XLNetForSequenceClassification
    named = cls.from_pretrained(classifier_dir, id2label={0: "neg", 1: "pos"}, dropout=0.3)
    assert named.config.label2id == {"neg": 0, "pos": 1}
    assert named.config.dropout == 0.3 and named.transformer.dropout.p == 0.3
    by_label2id = cls.from_pretrained(classifier_dir, label2id={"no": 0, "yes": 1})
    assert by_label2id.config.id2label == {0: "no", 1: "yes"}
    with pytest.raises(TypeError, match=r"no XLNetConfig field: \['foo'\]"):
        cls.from_pretrained(classifier_dir, foo=1)
    with pytest.raises(TypeError, match="set them on the config instead"):
        cls.from_pretrained(classifier_dir, config=XLNetConfig(**SMALL), dropout=0.2)


def test_from_pretrained_mismatched_weights_are_reported(classifier_dir, caplog):
    with caplog.at_level(logging.WARNING):
        xlnet_fast.XLNetForSequenceClassification.from_pretrained(classifier_dir, num_labels=4,
                                                                  ignore_mismatched_sizes=True)
    assert "logits_proj.weight" in caplog.text and "newly initialised" in caplog.text


def test_truncated_safetensors_names_the_file(lm_model, tmp_path):
    lm_model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors.*truncated or corrupted"):
        XLNetLMHeadModel.from_pretrained(tmp_path)


def test_corrupted_pytorch_bin_names_the_file(lm_model, tmp_path):
    lm_model.config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        XLNetLMHeadModel.from_pretrained(tmp_path)


def test_missing_and_unexpected_keys_reported_by_name(lm_model, tmp_path, caplog):
    from safetensors.torch import save_file

    lm_model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in lm_model.state_dict().items()
             if "mask_emb" not in k and k != "lm_loss.weight"}
    state["transformer.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        XLNetLMHeadModel.from_pretrained(tmp_path)
    text = caplog.text
    assert "transformer.mask_emb" in text and "transformer.extra.weight" in text


def test_wrong_shape_weight_is_an_error(lm_model, tmp_path):
    from safetensors.torch import save_file

    lm_model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in lm_model.state_dict().items() if k != "lm_loss.weight"}
    state["transformer.mask_emb"] = torch.zeros(1, 1, 7)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="transformer.mask_emb has shape"):
        XLNetLMHeadModel.from_pretrained(tmp_path)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        XLNetLMHeadModel.from_pretrained(tmp_path)
    XLNetConfig(**SMALL).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors or pytorch_model.bin"):
        XLNetLMHeadModel.from_pretrained(tmp_path)


def test_forward_passes_every_parameter_to_prepare_inputs_by_name():
    """XLNetModel.forward names each of its parameters in its call to prepare_inputs (no locals()):
    the two signatures list the same keywords, so a parameter added to one must be added to the other."""
    import inspect

    from xlnet_fast.model.inputs import prepare_inputs

    def named(function, skip):
        return [n for n, p in inspect.signature(function).parameters.items()
                if n not in skip and p.kind is not inspect.Parameter.VAR_KEYWORD]

    assert named(XLNetModel.forward, ("self",)) == named(prepare_inputs, ("model",))
    source = inspect.getsource(XLNetModel.forward)
    assert "locals()" not in source
    for name in named(XLNetModel.forward, ("self",)):
        assert f"{name}={name}" in source, name
