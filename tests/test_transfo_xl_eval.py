"""Long-context evaluation of a Transformer-XL (the original eval.py's loop): against the float64
reference carried over the same segments, and memory that covers the stream equals one forward over it."""

import pytest
import torch
from helpers.transfo_xl import SMALL, hf4_config, layout_state, reference_forward, reference_nll

from xlnet_fast import TransfoXLConfig, TransfoXLLMHeadModel
from xlnet_fast.transfo_xl.evaluate import stream_nll

TOKENS = torch.randint(0, SMALL["vocab_size"], (41,), generator=torch.Generator().manual_seed(0))


def model_and_reference(**fields):
    c = hf4_config(**dict(SMALL, **fields))
    state = layout_state(c, seed=6)
    model = TransfoXLLMHeadModel(TransfoXLConfig(**c, attn_backend="eager", mem_start="empty")).eval()  # eval.py's
    model.load_hf_state_dict(state)
    return model, c, state


def reference_stream(c, state, tokens, tgt_len, rows):
    """The original evaluation in float64: rows of consecutive text, segments of tgt_len predicting
    the next token, memory from empty carried across segments."""
    n = tokens.numel() // rows
    data = tokens[: n * rows].view(rows, n)
    mems = [torch.zeros(0, rows, c["d_model"], dtype=torch.float64) for _ in range(c["n_layer"])]
    total, count = 0.0, 0
    for start in range(0, n - 1, tgt_len):
        L = min(tgt_len, n - 1 - start)
        hidden, mems, _ = reference_forward(c, state, data[:, start:start + L], mems)
        nll = reference_nll(c, state, hidden.reshape(-1, c["d_model"]), data[:, start + 1:start + 1 + L].reshape(-1))
        total, count = total + float(nll.sum()), count + nll.numel()
    return total, count


@pytest.mark.parametrize("fields, tgt_len, rows", [
    (dict(mem_len=4), 3, 2),
    (dict(mem_len=5, same_length=True, clamp_len=2), 4, 3),
    (dict(mem_len=3, div_val=2, pre_lnorm=True), 6, 1),
])
def test_stream_perplexity_matches_the_float64_reference(fields, tgt_len, rows):
    model, c, state = model_and_reference(**fields)
    r = stream_nll(model, TOKENS, tgt_len, rows)
    total, count = reference_stream(c, state, TOKENS, tgt_len, rows)
    assert r["tokens"] == count == (TOKENS.numel() // rows - 1) * rows
    assert abs(r["loss_sum"] - total) / total < 1e-5


def test_memory_that_covers_the_stream_equals_one_forward():
    model, _, _ = model_and_reference(mem_len=48)
    segmented = stream_nll(model, TOKENS, tgt_len=5)
    whole = stream_nll(model, TOKENS, tgt_len=TOKENS.numel())
    assert segmented["segments"] == 8 and whole["segments"] == 1
    assert abs(segmented["loss_sum"] - whole["loss_sum"]) / whole["loss_sum"] < 1e-5
    short = stream_nll(model, TOKENS, tgt_len=5, max_segments=3)
    assert short["segments"] == 3 and short["tokens"] == 15
