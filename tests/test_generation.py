"""Generation carried by memory: Transformer-XL against greedy decoding of the float64 reference
(whole context, and memory bounded by mem_len), XLNet against transformers' ``generate`` on the same
weights (its dummy-token / offset-2 scheme, with and without mems), the token choice against
transformers' logits warpers, end of sequence, bad arguments."""

import pytest
import torch
from helpers.compare import rel_err
from helpers.models import token_ids, twins
from helpers.transfo_xl import SMALL, hf4_config, layout_state, reference_forward, reference_log_probs

from xlnet_fast import TransfoXLConfig, TransfoXLLMHeadModel
from xlnet_fast.generation import TokenChooser
from xlnet_fast.generation import TransfoXLCache

V = SMALL["vocab_size"]


def txl(seed=0, **fields):
    """(model, config dict, state): a small Transformer-XL with weights in 4.x's layout."""
    c = hf4_config(**dict(SMALL, **fields))
    state = layout_state(c, seed=seed, std=0.5)
    model = TransfoXLLMHeadModel(TransfoXLConfig(**c, attn_backend="eager")).eval()
    model.load_hf_state_dict(state)
    return model, c, state


def prompt(seed, batch=2, length=3):
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference_greedy(c, state, ids, n, mem_len=None):
    """Greedy decoding with the float64 reference: the whole sequence each step from an empty memory
    (``mem_len=None``), or the prompt then one token per step with the memory carried."""
    d = c["d_model"]
    empty = [torch.zeros(0, ids.shape[0], d, dtype=torch.float64) for _ in range(c["n_layer"])]
    seq = ids
    if mem_len is None:
        for _ in range(n):
            hidden, _, _ = reference_forward(c, state, seq, empty)
            seq = torch.cat([seq, reference_log_probs(c, state, hidden[:, -1]).argmax(-1, keepdim=True)], 1)
        return seq
    hidden, mems, _ = reference_forward(dict(c, mem_len=mem_len), state, seq, empty)
    for step in range(n):
        token = reference_log_probs(c, state, hidden[:, -1]).argmax(-1, keepdim=True)
        seq = torch.cat([seq, token], 1)
        assert all(m.shape[0] <= mem_len for m in mems)
        if step < n - 1:
            hidden, mems, _ = reference_forward(dict(c, mem_len=mem_len), state, token, mems)
    return seq


@pytest.mark.parametrize("fields", [dict(), dict(clamp_len=3, pre_lnorm=True), dict(div_val=2, untie_r=False)])
def test_transfo_xl_with_memory_equals_recomputing_the_whole_context(fields):
    model, c, state = txl(**dict(fields, mem_len=12))  # the memory holds every earlier token
    x = prompt(1)
    cached = model.generate(x, max_new_tokens=9, eos_token_id=None)
    assert cached.shape == (2, 12)
    assert len(set(cached[:, 3:].flatten().tolist())) > 2  # a varied continuation, not one repeated token
    assert torch.equal(cached, model.generate(x, max_new_tokens=9, eos_token_id=None, use_cache=False))
    assert torch.equal(cached, reference_greedy(c, state, x, 9))


@pytest.mark.parametrize("same_length", [False, True])
def test_transfo_xl_memory_is_bounded_by_mem_len(same_length):
    model, c, state = txl(seed=3, mem_len=4, same_length=same_length)
    x = prompt(2, length=5)
    out = model.generate(x, max_new_tokens=8, eos_token_id=None)
    assert torch.equal(out, reference_greedy(c, state, x, 8, mem_len=4))


def test_cached_keys_and_values_equal_the_forward_with_mems():
    model, _, _ = txl(seed=4, mem_len=5, pre_lnorm=True, same_length=True, clamp_len=3)
    cache, mems, mlen = TransfoXLCache(), model.init_mems(2, length=0), 0
    for seed, length in ((1, 4), (2, 1), (3, 3), (4, 1), (5, 1)):
        x = prompt(seed, length=length)
        hidden = model.transformer.generation_step(x, cache)
        with torch.no_grad():
            out = model.transformer(x, mems=mems)
        mems, mlen = out.mems, min(5, mlen + length)
        assert cache.mlen == mems[0].shape[0] == mlen
        assert rel_err(hidden, out.last_hidden_state) < 1e-6


def test_transfo_xl_starts_from_given_mems():
    model, c, state = txl(seed=5, mem_len=6)
    first = model(prompt(7), mems=model.init_mems(2, length=0))
    out = model.generate(prompt(8, length=1), max_new_tokens=4, eos_token_id=None, mems=first.mems)
    whole = model.generate(torch.cat([prompt(7), prompt(8, length=1)], 1), max_new_tokens=4, eos_token_id=None)
    assert torch.equal(out[:, 1:], whole[:, 4:])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("use_cache", [True, False])
def test_xlnet_greedy_tokens_equal_transformers_generate(seed, use_cache):
    hf, ours = twins("XLNetLMHeadModel", seed=seed, mem_len=10, initializer_range=0.5)
    x = token_ids(2, 4, seed)
    theirs = hf.generate(x, max_new_tokens=12, do_sample=False, use_mems=use_cache)
    mine = ours.generate(x, max_new_tokens=12, use_cache=use_cache)
    assert len(set(mine[:, 4:].flatten().tolist())) > 2
    assert mine.tolist() == theirs.tolist()


def test_xlnet_cache_changes_the_computation_as_in_transformers():
    _, ours = twins("XLNetLMHeadModel", seed=0, mem_len=10, initializer_range=0.5)
    x = token_ids(2, 4, 0)
    assert not torch.equal(ours.generate(x, max_new_tokens=12), ours.generate(x, max_new_tokens=12, use_cache=False))


def test_token_choice_matches_transformers_warpers():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                         TopPLogitsWarper)

    scores = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    for temperature, top_k, top_p in [(0.7, 5, 1.0), (1.3, 0, 0.6), (1.0, 10, 0.3), (0.5, 1, 0.9)]:
        chooser = TokenChooser(TransfoXLConfig(**SMALL), 4, "cpu", True, temperature, top_k, top_p)
        theirs = TemperatureLogitsWarper(temperature)(None, scores)
        if top_k:
            theirs = TopKLogitsWarper(top_k)(None, theirs)
        if top_p < 1:
            theirs = TopPLogitsWarper(top_p)(None, theirs)
        mine = chooser._warp(scores)
        assert torch.equal(torch.isinf(mine), torch.isinf(theirs))
        assert torch.allclose(mine[~torch.isinf(mine)], theirs[~torch.isinf(theirs)])


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model, _, _ = txl(seed=2, mem_len=10)
    x = prompt(4)
    greedy = model.generate(x, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(greedy, model.generate(x, max_new_tokens=6, eos_token_id=None, do_sample=True, top_k=1))
    runs = [model.generate(x, max_new_tokens=6, eos_token_id=None, do_sample=True,
                           generator=torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_eos_ends_a_row_and_pads_it():
    model, _, _ = txl(seed=0, mem_len=12)
    x = prompt(1)
    P, pad = x.shape[1], V - 1
    free = model.generate(x, max_new_tokens=9, eos_token_id=None)
    for eos in {int(free[0, P + 2]), int(free[1, P])}:
        expected, ends = free.clone(), []
        for row in range(2):
            hits = (free[row, P:] == eos).nonzero()
            if len(hits):
                ends.append(P + int(hits[0]))
                expected[row, ends[-1] + 1:] = pad
        out = model.generate(x, max_new_tokens=9, eos_token_id=eos, pad_token_id=pad)
        length = max(ends) + 1 if len(ends) == 2 else free.shape[1]  # all rows done: generation stops
        assert torch.equal(out, expected[:, :length])


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be >= 0"),
    (dict(temperature=0.0, do_sample=True), ValueError, "temperature must be a finite number > 0"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), ValueError, "top_k must be >= 0"),
    (dict(top_k=1.5), TypeError, "top_k must be an int"),
    (dict(eos_token_id=V), ValueError, r"eos_token_id must be in \[0, vocab_size=60\)"),
    (dict(do_sample="yes"), TypeError, "do_sample must be a bool"),
])
def test_bad_generation_arguments_are_named(kwargs, error, message):
    model, _, _ = txl()
    with pytest.raises(error, match=message):
        model.generate(prompt(0), **{"max_new_tokens": 3, **kwargs})
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, vocab_size=60\)"):
        model.generate(prompt(0) + V)
    with pytest.raises(ValueError, match="input_ids must be"):
        model.generate(prompt(0)[:, :0])
