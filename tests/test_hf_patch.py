"""patch_transformers: patched transformers models give the unpatched results without calling HF's
attention core; from_hf / to_hf; a Liger-style convergence check."""

import copy

import pytest
import torch
import transformers
from hf_utils import SMALL, rel_err, twins
from transformers.models.xlnet import modeling_xlnet

import xlnet_fast

B, L = 2, 9


def hf_model(name, seed=0, **overrides):
    torch.manual_seed(seed)
    return getattr(transformers, name)(transformers.XLNetConfig(**{**SMALL, **overrides})).eval()


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
    ref_model = hf_model("XLNetLMHeadModel", d_model=32, n_head=2, n_layer=1)
    ids, kw = inputs(two_stream=True)
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
