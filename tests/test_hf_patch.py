"""patch_transformers: patched transformers models give the unpatched results without calling HF's
attention core; the drop-in surface (signature, argument binding, every input transformers accepts,
generate, Trainer); from_hf / to_hf; a Liger-style convergence check."""

import copy
import inspect
import logging
import typing

import pytest
import torch
import transformers
from helpers.compare import rel_err
from helpers.models import SMALL, assert_visible, hf_model, scaled_hf_model, twins, without_positions
from helpers.spy import OpCalls, hf_core_calls
from transformers.models.xlnet import modeling_xlnet

import xlnet_fast

B, L = 2, 9


def inputs(two_stream=False):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(9, SMALL["vocab_size"], (B, L), generator=g)
    am = torch.ones(B, L)
    am[0, :2] = 0
    kw = dict(attention_mask=am, token_type_ids=(torch.arange(L) >= 5).long().expand(B, L))
    if two_stream:
        perm = (torch.rand(B, L, L, generator=g) > 0.5).float()
        perm[:, :, 2] = 0  # no fully blocked row (HF and we differ there by design)
        tm = torch.zeros(B, 3, L)
        for p, t in enumerate([3, 6, 8]):
            tm[:, p, t] = 1
        kw.update(perm_mask=perm, target_mapping=tm, labels=torch.randint(9, 50, (B, 3), generator=g))
    else:
        kw["labels"] = ids
    return ids, kw


ORIGINAL_CORE = modeling_xlnet.XLNetRelativeAttention.rel_attn_core


@pytest.fixture
def no_hf_attention_core(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("transformers' rel_attn_core was called")

    monkeypatch.setattr(modeling_xlnet.XLNetRelativeAttention, "rel_attn_core", fail)


def run_with_grads(model, ids, kw):
    model.zero_grad()
    out = model(ids, **kw)
    loss = out.loss if out.loss is not None else out.logits.square().mean()
    loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [("XLNetLMHeadModel", False), ("XLNetLMHeadModel", True), ("XLNetForSequenceClassification", False)]


@pytest.mark.parametrize("name,two_stream", CASES)
def test_patched_instance_matches_unpatched(name, two_stream, monkeypatch):
    ref_model = hf_model(name)
    ids, kw = inputs(two_stream)
    if name != "XLNetLMHeadModel":
        kw["labels"] = torch.tensor([0, 1])
    ref, ref_grads = run_with_grads(ref_model, ids, kw)

    patched = xlnet_fast.patch_transformers(copy.deepcopy(ref_model), backend="eager")
    monkeypatch.setattr(modeling_xlnet.XLNetRelativeAttention, "rel_attn_core",
                        lambda *a, **k: pytest.fail("HF attention core called"))
    out, grads = run_with_grads(patched, ids, kw)
    assert type(out) is type(ref)
    assert rel_err(out.logits, ref.logits) < 1e-5
    assert rel_err(out.loss, ref.loss) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        assert rel_err(grads[n], ref_grads[n]) < 1e-4, n


def test_patched_with_triton_backend(no_hf_attention_core):
    """On CPU in Triton's interpreter; on a GPU (the campaign runs it there) the compiled kernels."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref_model = hf_model("XLNetLMHeadModel", d_model=32, n_head=2, n_layer=1).to(device)
    ids, kw = inputs(two_stream=True)
    ids, kw = ids.to(device), {name: value.to(device) for name, value in kw.items()}
    patched = xlnet_fast.patch_transformers(copy.deepcopy(ref_model), backend="triton")
    out, grads = run_with_grads(patched, ids, kw)
    eager = xlnet_fast.patch_transformers(copy.deepcopy(ref_model), backend="eager")
    ref, ref_grads = run_with_grads(eager, ids, kw)
    assert rel_err(out.logits, ref.logits) < 1e-5
    for n in ref_grads:
        assert rel_err(grads[n], ref_grads[n]) < 1e-4, n


def test_class_patch_and_unpatch(no_hf_attention_core):
    xlnet_fast.patch_transformers(backend="eager")
    try:
        model = hf_model("XLNetForTokenClassification")  # built after patching
        ids, kw = inputs()
        kw["labels"] = torch.zeros(B, L, dtype=torch.long)
        out = model(ids, **kw)
        assert torch.isfinite(out.loss)
    finally:
        xlnet_fast.unpatch_transformers()
    with pytest.raises(AssertionError, match="rel_attn_core"):
        model(ids, **kw)


def test_unpatch_instance_restores_hf_forward():
    model = xlnet_fast.patch_transformers(hf_model("XLNetLMHeadModel"), backend="eager")
    assert "forward" in model.transformer.__dict__
    xlnet_fast.unpatch_transformers(model)
    assert "forward" not in model.transformer.__dict__


def test_patch_rejects_non_xlnet():
    with pytest.raises(ValueError, match="no transformers XLNetModel"):
        xlnet_fast.patch_transformers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="backend"):
        xlnet_fast.patch_transformers(hf_model("XLNetModel"), backend="cuda")


def test_patch_follows_parameters_and_mems():
    """Shared parameters: an optimizer step on the HF model is seen by the patched forward; mems
    carry over between calls like HF's."""
    ref_model = hf_model("XLNetLMHeadModel")
    patched = xlnet_fast.patch_transformers(copy.deepcopy(ref_model), backend="eager")
    with torch.no_grad():
        for m in (ref_model, patched):
            m.transformer.layer[0].rel_attn.q.mul_(1.5)
    ids, _ = inputs()
    a1, b1 = ref_model(ids, use_mems=True), patched(ids, use_mems=True)
    a2, b2 = ref_model(ids, mems=a1.mems), patched(ids, mems=b1.mems)
    assert rel_err(b2.logits, a2.logits) < 1e-5


def test_from_hf_and_to_hf_round_trip():
    hf, _ = twins("XLNetForSequenceClassification")
    ours = xlnet_fast.from_hf(hf, backend="eager")
    assert isinstance(ours, xlnet_fast.XLNetForSequenceClassification)
    back = xlnet_fast.to_hf(ours)
    assert isinstance(back, transformers.XLNetForSequenceClassification)
    ids, kw = inputs()
    kw.pop("labels")
    with torch.no_grad():
        ref = hf(ids, **kw).logits
        assert rel_err(ours(ids, **kw).logits, ref) < 1e-5
        assert rel_err(back.eval()(ids, **kw).logits, ref) < 1e-6


def test_a_model_on_the_meta_device_converts_patches_and_trains_there():
    """A transformers model whose weights are not materialised yet (built on the meta device, e.g.
    for a later ``to_empty`` or a sharded load) converts with ``from_hf`` and patches with
    ``patch_transformers``; both run a training step's forward and backward there (shapes only: the
    op on meta tensors, dropout on, transformers' dense masks). Regression: ``from_hf`` copied meta
    weights into a CPU model, ``patch_transformers`` took transformers' meta parameters for ones it
    had not shared, and the forward asked torch.autocast about the meta device."""
    with torch.device("meta"):
        hf = hf_model("XLNetLMHeadModel", dropout=0.1).to("meta").train()
    ours = xlnet_fast.from_hf(hf)
    assert all(p.is_meta for p in ours.parameters())
    assert {n: p.shape for n, p in ours.state_dict().items()} == \
        {n: p.shape for n, p in hf.state_dict().items() if n in ours.state_dict()}
    B, L, P = 2, 8, 3
    ids = torch.zeros(B, L, dtype=torch.long, device="meta")
    masks = dict(perm_mask=torch.zeros(B, L, L, device="meta"), target_mapping=torch.zeros(B, P, L, device="meta"),
                 labels=torch.zeros(B, P, dtype=torch.long, device="meta"))
    for model in (ours, xlnet_fast.patch_transformers(hf)):
        out = model(ids, **masks)
        out.loss.backward()
        assert out.logits.shape == (B, P, SMALL["vocab_size"]) and out.loss.is_meta
        assert model.transformer.layer[0].rel_attn.r_w_bias.grad.is_meta


def test_convergence_same_loss_curve_fp32():
    """Liger-style: train a tiny LM some steps with and without the patch; same loss curve."""
    def train(model, steps=15):
        torch.manual_seed(123)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(5)
        losses = []
        for _ in range(steps):
            ids = torch.randint(9, 50, (4, 12), generator=g)
            loss = model(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    base = hf_model("XLNetLMHeadModel").train()
    plain = train(copy.deepcopy(base))
    fast = train(xlnet_fast.patch_transformers(copy.deepcopy(base), backend="eager"))
    assert plain[-1] < plain[0] - 0.1  # it learns
    for a, b in zip(plain, fast):
        assert abs(a - b) <= 1e-4 * abs(a)


def test_peft_lora_model_patched_matches_unpatched():
    peft = pytest.importorskip("peft")
    base = hf_model("XLNetForSequenceClassification")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["layer_1", "layer_2"], init_lora_weights=False)
    ref_model = peft.get_peft_model(copy.deepcopy(base), lora)
    patched = xlnet_fast.patch_transformers(copy.deepcopy(ref_model), backend="eager")
    ids, kw = inputs()
    kw["labels"] = torch.tensor([1, 0])
    ref, ref_grads = run_with_grads(ref_model, ids, kw)
    out, grads = run_with_grads(patched, ids, kw)
    assert rel_err(out.logits, ref.logits) < 1e-5
    lora_grads = [n for n in ref_grads if "lora_" in n]
    assert lora_grads  # the adapters are trained through the patched forward
    for n in ref_grads:
        assert rel_err(grads[n], ref_grads[n]) < 1e-4, n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 curve with the fused kernels needs a GPU")
def test_convergence_bf16_on_gpu_is_close():
    def train(model, steps=30):
        torch.manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        g = torch.Generator(device="cuda").manual_seed(5)
        losses = []
        for _ in range(steps):
            ids = torch.randint(9, 50, (8, 64), generator=g, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return torch.tensor(losses)

    base = hf_model("XLNetLMHeadModel").cuda().train()
    plain = train(copy.deepcopy(base))
    fast = train(xlnet_fast.patch_transformers(copy.deepcopy(base), backend="triton"))
    assert plain[-1] < plain[0]
    assert ((plain - fast).abs() / plain).max() < 0.02


# ---------------------------------------------------------------------------------------------
# Drop-in surface: signature, argument binding, every input transformers accepts
# ---------------------------------------------------------------------------------------------


def assert_same_output(ours, ref, path="out"):
    """Same types and structure as transformers' output, tensors equal to 1e-5."""
    assert type(ours) is type(ref), f"{path}: {type(ours).__name__} != {type(ref).__name__}"
    if isinstance(ref, torch.Tensor):
        assert ours.shape == ref.shape, f"{path}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
        assert rel_err(ours, ref) <= 1e-5, f"{path}: rel err {rel_err(ours, ref)}"
    elif isinstance(ref, (tuple, list)):
        assert len(ours) == len(ref), f"{path}: {len(ours)} items != {len(ref)}"
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert_same_output(a, b, f"{path}[{i}]")
    elif isinstance(ref, transformers.utils.ModelOutput):
        assert list(ours.keys()) == list(ref.keys()), path
        for key in ref.keys():
            assert_same_output(ours[key], ref[key], f"{path}.{key}")
    else:
        assert ours == ref, path


@pytest.fixture
def class_patched():
    xlnet_fast.patch_transformers(backend="eager")
    yield
    xlnet_fast.unpatch_transformers()


def test_class_patch_keeps_transformers_signature(class_patched):
    patched = modeling_xlnet.XLNetModel.forward
    xlnet_fast.unpatch_transformers()
    original = modeling_xlnet.XLNetModel.forward
    xlnet_fast.patch_transformers(backend="eager")
    assert patched is not original
    assert inspect.signature(patched) == inspect.signature(original)
    assert patched.__wrapped__ is original and patched.__name__ == original.__name__
    assert typing.get_type_hints(patched) == typing.get_type_hints(original)
    model = hf_model("XLNetModel")
    assert model.main_input_name == list(inspect.signature(type(model).forward).parameters)[1]


def test_instance_patch_and_unpatch_keep_transformers_signature():
    model = hf_model("XLNetLMHeadModel")
    unpatched = inspect.signature(model.transformer.forward)
    xlnet_fast.patch_transformers(model, backend="eager")
    assert "forward" in model.transformer.__dict__
    assert inspect.signature(model.transformer.forward) == unpatched
    assert list(unpatched.parameters)[:3] == ["input_ids", "attention_mask", "mems"]
    xlnet_fast.unpatch_transformers(model)
    assert inspect.signature(model.transformer.forward) == unpatched


def backbone_pair(**overrides):
    ref = hf_model("XLNetModel", **overrides)
    return ref, xlnet_fast.patch_transformers(copy.deepcopy(ref), backend="eager")


def test_positional_arguments_bind_like_transformers():
    ref, patched = backbone_pair()
    ids, kw = inputs()
    # input_ids .. output_hidden_states positionally, return_dict=False as the 12th argument
    args = (ids, kw["attention_mask"], None, None, None, kw["token_type_ids"], None, None, True, False,
            True, False)
    with torch.no_grad():
        expected, out = ref(*args), patched(*args)
    assert isinstance(out, tuple)
    assert_same_output(out, expected)
    with pytest.raises(TypeError, match="positional"):
        patched(*args, None)
    with pytest.raises(TypeError, match="multiple values"):
        patched(*args, return_dict=True)


def _target_mapping(length, positions, batch=B):
    tm = torch.zeros(batch, len(positions), length)
    for p, t in enumerate(positions):
        tm[:, p, t] = 1.0
    return tm


def _fully_blocked_target():
    """perm_mask hides every key from position 4, a target: transformers averages all keys there."""
    perm = torch.zeros(B, L, L)
    perm[:, 4] = 1
    return dict(perm_mask=perm, target_mapping=_target_mapping(L, [4, 6]))


def _padded_target():
    """A batch row of padding only, with a target: its query row sees no key either."""
    am = torch.ones(B, L)
    am[1] = 0
    return dict(attention_mask=am, target_mapping=_target_mapping(L, [2]), output_attentions=True)


ACCEPTED_INPUTS = {  # inputs transformers' XLNetModel takes, some of them only loosely defined
    "target_mapping_longer_than_input": lambda mems: dict(target_mapping=_target_mapping(L + 1, [L]),
                                                          output_attentions=True),
    "target_mapping_shorter_than_input": lambda mems: dict(target_mapping=torch.rand(B, 2, L - 1)),
    "one_hot_targets_with_attentions_and_hidden_states": lambda mems: dict(
        target_mapping=_target_mapping(L, [3, 8]), perm_mask=(torch.rand(B, L, L) > 0.6).float(),
        token_type_ids=(torch.arange(L) >= 5).long().expand(B, L), output_attentions=True,
        output_hidden_states=True),
    "general_target_mapping_with_padding_and_mems": lambda mems: dict(
        target_mapping=torch.rand(B, 3, L), attention_mask=torch.tensor([[0.0] * 2 + [1.0] * (L - 2)] * B),
        mems=mems, output_attentions=True),
    "fully_blocked_query_rows": lambda mems: _fully_blocked_target(),
    "padding_only_row_with_target": lambda mems: _padded_target(),
    "mems_as_one_stacked_tensor": lambda mems: dict(mems=torch.stack(mems)),
    "mems_with_an_extra_layer": lambda mems: dict(mems=mems + (mems[0],)),
    "mems_with_a_missing_layer": lambda mems: dict(mems=[mems[0], None]),
    "perm_mask_broadcast_over_queries": lambda mems: dict(perm_mask=(torch.rand(B, 1, L) > 0.5).float()),
    "attention_mask_broadcast_over_keys": lambda mems: dict(attention_mask=torch.ones(B, 1)),
    "segment_ids_above_one": lambda mems: dict(token_type_ids=torch.tensor([[2] * L, [0, 1, 2] * 3])),
    "ignored_keywords": lambda mems: dict(head_mask=torch.ones(2, 4), position_ids=torch.arange(L),
                                          use_cache=False, output_hidden_states=True),
    "tuple_output_with_mems": lambda mems: dict(mems=mems, use_mems=True, return_dict=False,
                                                output_attentions=True),
}


@pytest.mark.parametrize("case", sorted(ACCEPTED_INPUTS))
def test_inputs_transformers_accepts_give_its_outputs(case):
    torch.manual_seed(1)
    ref, patched = backbone_pair()
    ids, _ = inputs()
    with torch.no_grad():
        mems = ref(ids, use_mems=True).mems
        kw = ACCEPTED_INPUTS[case](mems)
        expected = ref(ids, **kw)
        out = patched(ids, **kw)
    assert_same_output(out, expected)


@pytest.mark.parametrize("case", ["fully_blocked_query_rows", "padding_only_row_with_target",
                                  "one_hot_targets_with_attentions_and_hidden_states"])
def test_targets_with_blocked_rows_and_attentions_run_on_xlnet_fast(case, no_hf_attention_core):
    _, patched = backbone_pair()
    ids, _ = inputs()
    torch.manual_seed(1)
    with torch.no_grad():
        kw = ACCEPTED_INPUTS[case](None)
        assert torch.isfinite(patched(ids, **kw).last_hidden_state).all()


def test_mems_come_back_as_a_tuple_like_transformers(no_hf_attention_core):
    _, patched = backbone_pair()
    ids, _ = inputs()
    with torch.no_grad():
        out = patched(ids, use_mems=True)
        again = patched(ids, mems=out.mems, return_dict=False)
    assert type(out.mems) is tuple and len(out.mems) == SMALL["n_layer"]
    assert type(again[1]) is tuple


def test_extension_arguments_are_not_dropped_on_fallback():
    """q_rank/k_rank/target_pos reach xlnet_fast through **kwargs; with input it rejects, the error
    stays (transformers' forward would silently ignore them)."""
    _, patched = backbone_pair()
    ids, _ = inputs()
    with pytest.raises(ValueError, match="target_pos"):
        patched(ids, target_pos=torch.full((B, 1), L))


def test_generate_matches_unpatched(no_hf_attention_core):
    """generate() feeds XLNet a perm_mask, a one-token target_mapping and sliced mems every step."""
    ref = hf_model("XLNetLMHeadModel")
    patched = xlnet_fast.patch_transformers(copy.deepcopy(ref), backend="eager")
    ids, _ = inputs()
    settings = dict(max_new_tokens=4, do_sample=False, num_beams=2, output_scores=True,
                    return_dict_in_generate=True, pad_token_id=5)
    out = patched.generate(ids, **settings)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modeling_xlnet.XLNetRelativeAttention, "rel_attn_core", ORIGINAL_CORE)
        expected = ref.generate(ids, **settings)
    assert torch.equal(out.sequences, expected.sequences)
    assert_same_output(out.scores, expected.scores)


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------


def _trainer_losses(model, tmp_path, compute_loss_func=None):
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(16):
        ids = torch.randint(9, SMALL["vocab_size"], (L,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones(L, dtype=torch.long),
                     "labels": torch.tensor(i % 2), "text": f"sample {i}"})  # "text": removed by Trainer
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=4, learning_rate=5e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=7, label_names=["labels"],
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   compute_loss_func=compute_loss_func)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _pooled_loss(outputs, labels, num_items_in_batch=None):
    hidden = outputs.last_hidden_state.mean(1)
    return torch.nn.functional.cross_entropy(hidden[:, :2], labels)


@pytest.mark.parametrize("name", ["XLNetModel", "XLNetForSequenceClassification"])
def test_trainer_fine_tuning_same_loss_curve(name, tmp_path):
    """transformers' Trainer (unused columns removed by the forward's signature) trains the patched
    model like the unpatched one."""
    base = hf_model(name).train()
    loss_func = _pooled_loss if name == "XLNetModel" else None
    plain = _trainer_losses(copy.deepcopy(base), tmp_path / "plain", loss_func)
    fast = _trainer_losses(xlnet_fast.patch_transformers(copy.deepcopy(base), backend="eager"),
                           tmp_path / "fast", loss_func)
    assert len(plain) == 5
    assert plain == pytest.approx(fast, rel=1e-4)


# ---------------------------------------------------------------------------------------------
# Which forward ran: xlnet_fast's (the op's calls, on the patch's backend) or transformers' own
# (its attention core's calls), at a weight scale where every term matters (helpers.models.SCALE)
# ---------------------------------------------------------------------------------------------


def _tm(positions, length=L):
    return _target_mapping(length, positions)


TOKEN_TYPES = (torch.arange(L) >= 5).long().expand(B, L)
# case: (model class, config overrides, keywords of the second call; the first call gives it its mems)
PATCH_RUNS = {
    "lm_mems_segments_padding": ("XLNetLMHeadModel", {}, dict(token_type_ids=TOKEN_TYPES,
                                                             attention_mask=inputs()[1]["attention_mask"])),
    "two_stream_perm_mask_targets": ("XLNetLMHeadModel", {}, dict(
        token_type_ids=TOKEN_TYPES, perm_mask=inputs(two_stream=True)[1]["perm_mask"], target_mapping=_tm([3, 6, 8]))),
    "soft_target_mapping": ("XLNetLMHeadModel", {}, dict(
        token_type_ids=TOKEN_TYPES, target_mapping=torch.rand(B, 2, L, generator=torch.Generator().manual_seed(3)))),
    "targets_with_attentions": ("XLNetLMHeadModel", {}, dict(target_mapping=_tm([0, 4]), output_attentions=True)),
    "bi_data_clamp_len": ("XLNetLMHeadModel", dict(bi_data=True, clamp_len=3), dict(token_type_ids=TOKEN_TYPES)),
    "uni_same_length": ("XLNetLMHeadModel", dict(attn_type="uni", same_length=True), {}),
    "sequence_classification": ("XLNetForSequenceClassification", {}, dict(
        token_type_ids=TOKEN_TYPES, attention_mask=inputs()[1]["attention_mask"])),
}


def _loss(out):
    logits = out.logits
    return (logits * torch.linspace(-1, 1, logits.shape[-1])).sum()


@pytest.mark.parametrize("case", sorted(PATCH_RUNS))
def test_patched_forward_runs_xlnet_fast(case, monkeypatch):
    """Every forward of the patched model, the one given mems included, runs xlnet_fast's op on the
    patch's backend and never transformers' attention core; outputs and gradients are transformers'
    at a scale where the memory and the positions change them far above the tolerance."""
    name, overrides, kw = PATCH_RUNS[case]
    ref_model = scaled_hf_model(name, **overrides)
    patched = xlnet_fast.patch_transformers(copy.deepcopy(ref_model), backend="eager")
    ids, _ = inputs()
    with torch.no_grad():
        mems = ref_model(ids.flip(1), use_mems=True).mems
        expected = ref_model(ids, mems=mems, **kw)
        assert_visible("the memory", ref_model(ids, **kw).logits, expected.logits, 1e-5)
        assert_visible("the positions", without_positions(ref_model)(ids, mems=mems, **kw).logits, expected.logits,
                       1e-5)
    ref_model.zero_grad()
    _loss(ref_model(ids, mems=mems, **kw)).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}
    n_layer = ref_model.config.n_layer
    with hf_core_calls(monkeypatch) as hf_core, OpCalls() as ops:
        with torch.no_grad():
            first = patched(ids.flip(1), use_mems=True)
            assert ops.count() >= n_layer and hf_core == [0]
        out = patched(ids, mems=first.mems, **kw)
        assert ops.count() >= 2 * n_layer and hf_core == [0], (ops.calls, hf_core)
        _loss(out).backward()
    assert ops.backends() == {"eager"} and ops.count("rel_attention_backward") >= n_layer
    assert rel_err(out.logits, expected.logits) < 1e-5
    grads = {n: p.grad for n, p in patched.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        assert rel_err(grads[n], ref_grads[n]) < 1e-4, n


# the inputs of ACCEPTED_INPUTS that xlnet_fast's own XLNetModel rejects: transformers' forward runs them
FALLS_BACK = {"attention_mask_broadcast_over_keys", "mems_with_a_missing_layer", "mems_with_an_extra_layer",
              "perm_mask_broadcast_over_queries", "target_mapping_longer_than_input",
              "target_mapping_shorter_than_input"}


@pytest.mark.parametrize("case", sorted(ACCEPTED_INPUTS))
def test_each_accepted_input_runs_the_forward_it_should(case, monkeypatch):
    assert FALLS_BACK <= set(ACCEPTED_INPUTS)
    torch.manual_seed(1)
    ref, patched = backbone_pair()
    ids, _ = inputs()
    with torch.no_grad():
        mems = ref(ids, use_mems=True).mems
        kw = ACCEPTED_INPUTS[case](mems)
        with hf_core_calls(monkeypatch) as hf_core, OpCalls() as ops:
            patched(ids, **kw)
    if case in FALLS_BACK:
        assert ops.count() == 0 and hf_core[0] >= SMALL["n_layer"], (ops.calls, hf_core)  # one per stream
    else:
        assert ops.count() >= SMALL["n_layer"] and hf_core == [0], (ops.calls, hf_core)


def test_each_kind_of_rejection_is_warned_once(monkeypatch, caplog):
    """Regression: the once-only fallback warning was keyed on the message's first word, so a float
    token_type_ids (a wrong dtype) silenced the warning for a (B, 1) one (a wrong shape). Now one
    warning per kind of rejection; the same kind at other sizes is not warned again."""
    from xlnet_fast import hf_patch

    monkeypatch.setattr(hf_patch, "_fallbacks_logged", set(), raising=False)
    _, patched = backbone_pair()
    ids, _ = inputs()
    calls = [dict(token_type_ids=TOKEN_TYPES.float()), dict(token_type_ids=TOKEN_TYPES.float().flip(1)),
             dict(token_type_ids=torch.ones(B, 1, dtype=torch.long)), dict(target_mapping=_tm([L], L + 1)),
             dict(target_mapping=torch.rand(B, 2, L - 1))]
    with caplog.at_level(logging.WARNING, logger="xlnet_fast.hf_patch"), torch.no_grad():
        for kw in calls:
            patched(ids, **kw)
    warned = [r.getMessage() for r in caplog.records if "does not take this input" in r.getMessage()]
    assert len(warned) == 3, warned
    assert sum("token_type_ids must be an integer tensor" in w for w in warned) == 1
    assert sum("token_type_ids must have shape" in w for w in warned) == 1
    assert sum("target_mapping must have shape" in w for w in warned) == 1
