"""Bad input gets a clear error naming the argument; edge cases stay finite; broken files are
reported by name."""

import logging
import os

import pytest
import torch
from hf_utils import SMALL

import xlnet_fast
from xlnet_fast import XLNetConfig, XLNetLMHeadModel, XLNetModel

B, L = 2, 6


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return XLNetLMHeadModel(XLNetConfig(**SMALL, attn_backend="eager")).eval()


def ids():
    return torch.randint(9, SMALL["vocab_size"], (B, L), generator=torch.Generator().manual_seed(0))


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
    (dict(target_pos=torch.zeros(B, 2, dtype=torch.long), target_mapping=torch.zeros(B, 2, L)), ValueError,
     "either target_mapping or target_pos"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_INPUTS)
def test_model_rejects_bad_input_naming_the_argument(model, kwargs, exc, match):
    kwargs = dict(kwargs)
    x = kwargs.pop("input_ids", ids())
    with pytest.raises(exc, match=match):
        model(x, **kwargs)


def test_inputs_embeds_checked(model):
    with pytest.raises(ValueError, match="inputs_embeds must be"):
        model(inputs_embeds=torch.zeros(B, L, 7))
    with pytest.raises(ValueError, match="either input_ids or inputs_embeds"):
        model()


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


def test_long_sequence_eager_bf16_is_finite():
    torch.manual_seed(0)
    m = XLNetModel(XLNetConfig(**dict(SMALL, n_layer=1), attn_backend="eager")).to(torch.bfloat16)
    x = torch.randint(9, 50, (1, 1024))
    am = torch.ones(1, 1024)
    am[:, :300] = 0
    out = m(x, attention_mask=am).last_hidden_state
    out.float().square().mean().backward()
    assert _finite(out.float())


def test_eager_out_of_memory_points_to_triton(monkeypatch):
    from xlnet_fast.attention import eager

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(eager, "forward", oom)
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(torch.OutOfMemoryError, match="backend='triton'"):
        xlnet_fast.rel_attention(q, q, q, torch.randn(1, 8, 1, 8), torch.zeros(1, 8), torch.zeros(1, 8),
                                 backend="eager")


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def test_truncated_safetensors_names_the_file(model, tmp_path):
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors.*truncated or corrupted"):
        XLNetLMHeadModel.from_pretrained(tmp_path)


def test_corrupted_pytorch_bin_names_the_file(model, tmp_path):
    model.config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        XLNetLMHeadModel.from_pretrained(tmp_path)


def test_missing_and_unexpected_keys_reported_by_name(model, tmp_path, caplog):
    from safetensors.torch import save_file

    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if "mask_emb" not in k and k != "lm_loss.weight"}
    state["transformer.extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        XLNetLMHeadModel.from_pretrained(tmp_path)
    text = caplog.text
    assert "transformer.mask_emb" in text and "transformer.extra.weight" in text


def test_wrong_shape_weight_is_an_error(model, tmp_path):
    from safetensors.torch import save_file

    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_loss.weight"}
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


def test_corrupted_latest_training_checkpoint_falls_back(tmp_path, caplog):
    from xlnet_fast.pretrain import TrainConfig, load_latest_checkpoint

    cfg = TrainConfig(out=str(tmp_path))
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        d = root / f"step_{step:07d}"
        os.makedirs(d)
        torch.save({"step": step}, d / "trainer.pt")
        (d / "COMPLETE").write_text(str(step))
    (root / "step_0000004" / "trainer.pt").write_bytes(b"garbage")
    os.makedirs(root / "step_0000006.tmp")  # a half-written one is never picked
    with caplog.at_level(logging.WARNING):
        assert load_latest_checkpoint(cfg) == str(root / "step_0000002")
    assert "step_0000004" in caplog.text and "falling back" in caplog.text


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    lines = [" ".join(words[(i * 7 + j) % 8] for j in range(6)) for i in range(500)]
    return xlnet_fast.train_tokenizer(lines, 40, tmp_path_factory.mktemp("tok"))


def test_tokenizer_empty_string(tok):
    enc = tok("", return_tensors="pt")
    assert enc["input_ids"].tolist() == [[4, 3]]  # <sep> <cls>
    assert tok.decode([]) == ""


def test_tokenizer_unknown_characters_map_to_unk(tok):
    ids = tok.encode("alpha \u2603\u2603 beta", add_special_tokens=False)
    assert 0 in ids  # <unk>
    assert "alpha" in tok.decode(ids) and "beta" in tok.decode(ids)


def test_tokenizer_over_long_input(tok):
    long = "alpha beta " * 500
    enc = tok([long, "gamma"], truncation=True, max_length=32, padding=True, return_tensors="pt")
    assert enc["input_ids"].shape == (2, 32)
    assert enc["input_ids"][0, -1] == 3 and enc["attention_mask"][1].sum() < 32
    with pytest.raises(ValueError, match="max_length"):
        tok("alpha", max_length=1, truncation=True, text_pair="beta")
    with pytest.raises(TypeError, match="text"):
        tok.encode(None)
