"""Our XLNet against transformers' on random small configs: same weights, float32, eager backend."""

import pytest
import torch
import transformers
from helpers.compare import rel_err
from helpers.models import SMALL, token_ids, twins

import xlnet_fast
from xlnet_fast import XLNetConfig, local_perm

TOL = 1e-4
B, L = 2, 7


def ids(seed=0, batch=B, length=L):
    return token_ids(batch, length, seed)


def one_hot_targets(positions, batch=B, length=L):
    tm = torch.zeros(batch, len(positions), length)
    for p, t in enumerate(positions):
        tm[:, p, t] = 1.0
    return tm


def random_perm_mask(seed=0, batch=B, length=L):
    """Random dense perm_mask; key 0 stays visible so no row is fully blocked (HF averages such
    rows uniformly, we return zeros, docs/DESIGN.md §2)."""
    mask = (torch.rand(batch, length, length, generator=torch.Generator().manual_seed(seed)) > 0.5).float()
    mask[:, :, 0] = 0
    return mask


def left_pad_mask():
    am = torch.ones(B, L)
    am[0, :2] = 0
    return am


def token_types():
    return torch.tensor([[3, 3, 0, 0, 1, 1, 2], [0, 0, 0, 1, 1, 1, 2]])


def assert_close_outputs(ours, hf, fields):
    for f in fields:
        a, b = getattr(ours, f), getattr(hf, f)
        assert rel_err(a, b) < TOL, f"{f}: rel err {rel_err(a, b)}"


@pytest.mark.parametrize("overrides", [
    {}, {"bi_data": True}, {"clamp_len": 3}, {"reuse_len": 4}, {"mem_len": 0},
    {"ff_activation": "relu"},
])
def test_lm_head_with_mems_over_two_calls(overrides):
    hf, ours = twins("XLNetLMHeadModel", **overrides)
    x1, x2 = ids(1), ids(2)
    with torch.no_grad():
        a1, b1 = hf(x1, attention_mask=left_pad_mask()), ours(x1, attention_mask=left_pad_mask())
        a2, b2 = hf(x2, mems=a1.mems), ours(x2, mems=b1.mems)
    assert_close_outputs(b1, a1, ["logits"])
    assert_close_outputs(b2, a2, ["logits"])
    assert len(b2.mems) == len(a2.mems)
    for m_ours, m_hf in zip(b2.mems, a2.mems):
        assert m_ours.shape == m_hf.shape
        assert rel_err(m_ours, m_hf) < TOL


@pytest.mark.parametrize("attn_type", ["bi", "uni"])
def test_two_stream_with_perm_mask_target_mapping_labels_and_grads(attn_type):
    # transformers' "uni" + any data mask only broadcasts for batch 1
    batch = 1 if attn_type == "uni" else B
    hf, ours = twins("XLNetLMHeadModel", attn_type=attn_type)
    x = ids(3, batch)
    kw = dict(perm_mask=random_perm_mask(4, batch), target_mapping=one_hot_targets([1, 4, 6], batch),
              token_type_ids=token_types()[:batch], labels=ids(5, batch, 3))
    a, b = hf(x, **kw), ours(x, **kw)
    assert_close_outputs(b, a, ["logits", "loss"])
    a.loss.backward()
    b.loss.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, hf_params[name].grad) < 1e-3, name


def test_general_target_mapping_path():
    """A target_mapping that is not one-hot (soft weights, a position targeted twice) still works."""
    hf, ours = twins("XLNetLMHeadModel")
    tm = torch.rand(B, 3, L)
    tm2 = one_hot_targets([2, 2, 5])
    with torch.no_grad():
        for t in (tm, tm2):
            a = hf(ids(), perm_mask=random_perm_mask(), target_mapping=t)
            b = ours(ids(), perm_mask=random_perm_mask(), target_mapping=t)
            assert_close_outputs(b, a, ["logits"])


def test_target_mapping_with_padding_only_and_empty_prediction_rows():
    hf, ours = twins("XLNetLMHeadModel")
    tm = one_hot_targets([1, 4, 6])
    tm[1, 2] = 0  # an unused prediction slot
    with torch.no_grad():
        a = hf(ids(), attention_mask=left_pad_mask(), token_type_ids=token_types(), target_mapping=tm)
        b = ours(ids(), attention_mask=left_pad_mask(), token_type_ids=token_types(), target_mapping=tm)
    assert_close_outputs(b, a, ["logits"])


def test_uni_same_length_and_mems():
    hf, ours = twins("XLNetLMHeadModel", attn_type="uni", same_length=True)
    with torch.no_grad():
        a1, b1 = hf(ids(1)), ours(ids(1))
        a2, b2 = hf(ids(2), mems=a1.mems), ours(ids(2), mems=b1.mems)
    assert_close_outputs(b1, a1, ["logits"])
    assert_close_outputs(b2, a2, ["logits"])


def test_compact_rank_inputs_equal_dense_perm_mask():
    """The model's own permutation inputs (ranks + target positions) give HF's dense-mask result."""
    hf, ours = twins("XLNetLMHeadModel")
    x = ids(7)
    gen = torch.Generator().manual_seed(0)
    q_ranks, k_ranks, masks, targets = [], [], [], []
    for b in range(B):
        is_masked = torch.zeros(L, dtype=torch.bool)
        is_masked[torch.tensor([1, 4, 5])] = True
        q_rank, k_rank, is_target = local_perm(x[b], is_masked, L, sep_id=4, cls_id=3, generator=gen)
        q_ranks.append(q_rank)
        k_ranks.append(k_rank)
        masks.append((q_rank[:, None] <= k_rank[None, :]).float())
        targets.append(is_target.nonzero().flatten())
    target_pos = torch.stack(targets)
    tm = torch.zeros(B, target_pos.shape[1], L).scatter_(2, target_pos[..., None], 1.0)
    with torch.no_grad():
        a = hf(x, perm_mask=torch.stack(masks), target_mapping=tm, token_type_ids=token_types())
        b = ours(x, q_rank=torch.stack(q_ranks), k_rank=torch.stack(k_ranks), target_pos=target_pos,
                 token_type_ids=token_types())
    assert_close_outputs(b, a, ["logits"])


def test_hidden_states_and_attentions():
    hf, ours = twins("XLNetLMHeadModel")
    kw = dict(perm_mask=random_perm_mask(), target_mapping=one_hot_targets([0, 3]),
              output_hidden_states=True, output_attentions=True)
    with torch.no_grad():
        a, b = hf(ids(), **kw), ours(ids(), **kw)
    assert len(a.hidden_states) == len(b.hidden_states)
    for x, y in zip(b.hidden_states, a.hidden_states):
        assert rel_err(x, y) < TOL
    for (ph, pg), (qh, qg) in zip(b.attentions, a.attentions):
        assert rel_err(ph, qh) < TOL and rel_err(pg, qg) < TOL


HEADS = {
    "XLNetModel": dict(fields=["last_hidden_state"]),
    "XLNetForSequenceClassification": dict(fields=["logits", "loss"], labels=dict(labels=torch.tensor([0, 1]))),
    "XLNetForTokenClassification": dict(fields=["logits", "loss"], labels=dict(labels=torch.randint(0, 2, (B, L)))),
    "XLNetForQuestionAnsweringSimple": dict(fields=["start_logits", "end_logits", "loss"],
                                            labels=dict(start_positions=torch.tensor([1, 2]),
                                                        end_positions=torch.tensor([3, 5]))),
    "XLNetForQuestionAnswering": dict(fields=["loss"], labels=dict(
        start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 5]),
        cls_index=torch.tensor([6, 6]), is_impossible=torch.tensor([0.0, 1.0]))),
}


@pytest.mark.parametrize("name", sorted(HEADS))
def test_heads_match(name):
    spec = HEADS[name]
    hf, ours = twins(name)
    kw = dict(attention_mask=left_pad_mask(), token_type_ids=token_types(), **spec.get("labels", {}))
    with torch.no_grad():
        a, b = hf(ids(), **kw), ours(ids(), **kw)
    assert_close_outputs(b, a, spec["fields"])


def test_question_answering_inference_outputs():
    hf, ours = twins("XLNetForQuestionAnswering", start_n_top=3, end_n_top=2)
    p_mask = torch.zeros(B, L)
    p_mask[:, 0] = 1
    with torch.no_grad():
        a, b = hf(ids(), p_mask=p_mask), ours(ids(), p_mask=p_mask)
    assert_close_outputs(b, a, ["start_top_log_probs", "end_top_log_probs", "cls_logits"])
    assert torch.equal(a.start_top_index, b.start_top_index)
    assert torch.equal(a.end_top_index, b.end_top_index)


def test_multiple_choice():
    hf, ours = twins("XLNetForMultipleChoice")
    x = torch.randint(9, 50, (2, 3, L))
    am = torch.ones(2, 3, L)
    am[:, :, 0] = 0
    with torch.no_grad():
        a = hf(x, attention_mask=am, labels=torch.tensor([0, 2]))
        b = ours(x, attention_mask=am, labels=torch.tensor([0, 2]))
    assert b.logits.shape == (2, 3)
    assert_close_outputs(b, a, ["logits", "loss"])


def test_return_dict_false_gives_tuples_like_hf():
    hf, ours = twins("XLNetLMHeadModel")
    with torch.no_grad():
        a = hf(ids(), return_dict=False, use_mems=True)
        b = ours(ids(), return_dict=False, use_mems=True)
    assert len(a) == len(b)
    assert rel_err(b[0], a[0]) < TOL


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.bool])
def test_token_type_ids_of_any_integer_dtype_as_transformers_takes_them(dtype):
    """Regression: token_type_ids in a narrow integer dtype or bool (transformers compares them with
    ``!=``) were refused with a TypeError naming ``q_seg``, an argument the caller never passed."""
    hf, ours = twins("XLNetLMHeadModel")
    types = (token_types() % 2 if dtype == torch.bool else token_types()).to(dtype)
    with torch.no_grad():
        a = hf(ids(), token_type_ids=types, attention_mask=left_pad_mask())
        b = ours(ids(), token_type_ids=types, attention_mask=left_pad_mask())
    assert rel_err(b.logits, a.logits) < TOL


# ---------------------------------------------------------------------------------------------
# Save / load round trips with transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["XLNetLMHeadModel", "XLNetForSequenceClassification", "XLNetModel"])
def test_load_a_directory_written_by_transformers(tmp_path, name):
    hf, _ = twins(name)
    hf.save_pretrained(tmp_path)
    ours = getattr(xlnet_fast, name).from_pretrained(tmp_path, attn_backend="eager").eval()
    with torch.no_grad():
        a, b = hf(ids()), ours(ids())
    assert rel_err(b[0], a[0]) < TOL


def test_load_pytorch_model_bin(tmp_path):
    hf, _ = twins("XLNetLMHeadModel")
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    ours = xlnet_fast.XLNetLMHeadModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert rel_err(ours(ids()).logits, hf(ids()).logits) < TOL


def test_transformers_loads_what_we_save(tmp_path):
    _, ours = twins("XLNetLMHeadModel", seed=3)
    ours.save_pretrained(tmp_path)
    hf = transformers.XLNetLMHeadModel.from_pretrained(tmp_path).eval()
    assert hf.lm_loss.weight.data_ptr() == hf.transformer.word_embedding.weight.data_ptr()
    with torch.no_grad():
        assert rel_err(ours(ids()).logits, hf(ids()).logits) < TOL


def test_base_model_loads_from_head_checkpoint_and_back(tmp_path):
    _, lm = twins("XLNetLMHeadModel")
    lm.save_pretrained(tmp_path / "lm")
    base = xlnet_fast.XLNetModel.from_pretrained(tmp_path / "lm")
    torch.testing.assert_close(base.word_embedding.weight, lm.transformer.word_embedding.weight)
    base.save_pretrained(tmp_path / "base")
    cls = xlnet_fast.XLNetForSequenceClassification.from_pretrained(tmp_path / "base")
    torch.testing.assert_close(cls.transformer.layer[1].rel_attn.q, lm.transformer.layer[1].rel_attn.q)


def test_config_round_trip(tmp_path):
    cfg = XLNetConfig(**SMALL, bi_data=True, attn_backend="eager", num_labels=3)
    cfg.save_pretrained(tmp_path)
    again = XLNetConfig.from_pretrained(tmp_path)
    assert again == cfg and again.num_labels == 3
    hf_cfg = transformers.XLNetConfig.from_pretrained(tmp_path)
    assert hf_cfg.d_model == cfg.d_model and hf_cfg.bi_data and hf_cfg.num_labels == 3
