"""The conventions users rely on: clear errors naming the argument, what transformers accepts and
ignores, loading in eval mode with config overrides."""

import logging

import pytest
import torch
import transformers
from hf_utils import SMALL, rel_err, twins

import xlnet_fast
from xlnet_fast import XLNetConfig, XLNetModel

B, L = 2, 6


def ids(seed=0):
    return torch.randint(9, SMALL["vocab_size"], (B, L), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return XLNetModel(XLNetConfig(**SMALL, attn_backend="eager")).eval()


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
# from_pretrained
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
