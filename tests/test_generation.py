"""Generation carried by memory: Transformer-XL against greedy decoding of the float64 reference
(whole context, and memory bounded by mem_len), XLNet against transformers' ``generate`` on the same
weights (its dummy-token / offset-2 scheme, with and without mems), the token choice against
transformers' logits warpers, end of sequence, bad arguments."""

import pytest
import torch
from helpers.compare import rel_err
from hypothesis import given, settings
from hypothesis import strategies as st
from helpers.models import token_ids, twins
from helpers.transfo_xl import SMALL, hf4_config, layout_state, reference_forward, reference_log_probs

from xlnet_fast import TransfoXLConfig, TransfoXLLMHeadModel
from xlnet_fast.generation import TokenChooser
from xlnet_fast.generation import TransfoXLCache

V = SMALL["vocab_size"]


def txl(seed=0, **fields):
    """(model, config dict, state): a small Transformer-XL with weights in 4.x's layout, starting from
    the original code's empty memory (the start these tests were written for)."""
    c = hf4_config(**dict(SMALL, **fields))
    state = layout_state(c, seed=seed, std=0.5)
    model = TransfoXLLMHeadModel(TransfoXLConfig(**c, attn_backend="eager", mem_start="empty")).eval()
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


# --------------------------------------------------------------------------------------------------
# One meaning of "no memory" (issue 36): forward, evaluation and generate start from init_mems
# --------------------------------------------------------------------------------------------------


def greedy_over_forward(model, x, n, start):
    """Greedy decoding over the model's own forward: the prompt from ``init_mems(B, start=start)``
    (``start=None``: the forward's own ``mems=None``), then one token per forward with ``mems`` carried."""
    with torch.no_grad():
        out = model(x, mems=None if start is None else model.init_mems(x.shape[0], start=start))
        seq = x
        for _ in range(n):
            token = out.prediction_scores[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, token], 1)
            out = model(token, mems=out.mems)
    return seq


@settings(max_examples=10, deadline=None)
@given(div_val=st.sampled_from([1, 2]), same_length=st.booleans(), pre_lnorm=st.booleans(),
       clamp_len=st.integers(-1, 4), untie_r=st.booleans(), mem_len=st.integers(1, 8),
       d_embed=st.sampled_from([12, 16]), start=st.sampled_from(["zeros", "empty"]), seed=st.integers(0, 50))
def test_generate_is_greedy_decoding_over_the_models_own_forward(div_val, same_length, pre_lnorm, clamp_len, untie_r,
                                                                  mem_len, d_embed, start, seed):
    """From either start, with mem_len below the final length (3 + 9 tokens), cached and uncached: the
    tokens of a loop over ``model(...)`` with ``mems`` carried from the forward's own start."""
    fields = dict(div_val=div_val, same_length=same_length, pre_lnorm=pre_lnorm, clamp_len=clamp_len, untie_r=untie_r,
                  mem_len=mem_len, d_embed=16 if div_val == 2 else d_embed)
    c = hf4_config(**dict(SMALL, **fields))
    model = TransfoXLLMHeadModel(TransfoXLConfig(**c, attn_backend="eager", mem_start=start)).eval()
    model.load_hf_state_dict(layout_state(c, seed=seed, std=0.5))
    x = prompt(seed)
    expected = greedy_over_forward(model, x, 9, start=None)
    assert torch.equal(model.generate(x, max_new_tokens=9, eos_token_id=None), expected)
    other = "empty" if start == "zeros" else "zeros"  # the other start, by name
    assert torch.equal(model.generate(x, max_new_tokens=9, eos_token_id=None, mem_start=other),
                       greedy_over_forward(model, x, 9, start=other))


def test_the_default_start_is_transformers_zero_memory_and_both_starts_differ():
    model, c, state = txl(seed=6, mem_len=6)
    model.config.mem_start = "zeros"
    x = prompt(3)
    zeros = model.init_mems(2)
    assert [m.shape for m in zeros] == [(6, 2, c["d_model"])] * c["n_layer"] and all(not m.any() for m in zeros)
    assert model.init_mems(2, start="empty")[0].shape == (0, 2, c["d_model"])
    with torch.no_grad():
        hidden, _, _ = reference_forward(c, state, x)  # the reference's mems=None: 4.x's zeros
        assert rel_err(model.transformer(x).last_hidden_state, hidden) < 1e-5
    from_zeros = model.generate(x, max_new_tokens=8, eos_token_id=None)
    from_empty = model.generate(x, max_new_tokens=8, eos_token_id=None, mem_start="empty")
    assert not torch.equal(from_zeros, from_empty)  # the start shows in the tokens of this model
    assert torch.equal(from_zeros, model.generate(x, max_new_tokens=8, eos_token_id=None, mems=zeros))
    with pytest.raises(ValueError, match="mem_start must be one of"):
        TransfoXLConfig(**c, mem_start="none")
    with pytest.raises(ValueError, match="mems= .* or mem_start="):
        model.generate(x, mems=zeros, mem_start="empty")


@pytest.mark.parametrize("start", ["zeros", "empty"])
def test_evaluation_starts_where_forward_does(start):
    from xlnet_fast.transfo_xl.evaluate import stream_nll

    model, c, state = txl(seed=7, mem_len=4)
    model.config.mem_start = start
    tokens = torch.randint(0, V, (13,), generator=torch.Generator().manual_seed(1))
    first = stream_nll(model, tokens, tgt_len=5, max_segments=1)  # one row: the first 5 tokens scoring the next
    with torch.no_grad():
        loss = model(tokens[None, :6], labels=tokens[None, :6]).losses  # mems=None
    assert first["tokens"] == 5 and abs(first["loss_sum"] - float(loss.double().sum())) < 1e-5


# --------------------------------------------------------------------------------------------------
# transformers' keywords (issue 36)
# --------------------------------------------------------------------------------------------------


def test_transfo_xl_scores_and_return_dict():
    model, _, _ = txl(seed=8, mem_len=4)
    x = prompt(5)
    out = model.generate(x, max_new_tokens=5, eos_token_id=None, num_beams=1, output_scores=True,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(x, max_new_tokens=5, eos_token_id=None))
    assert out["sequences"] is out.sequences and len(out.scores) == 5
    with torch.no_grad():  # each step's scores: the log-probabilities of the forward with mems carried
        step = model(x, mems=model.init_mems(2))
        for n, scores in enumerate(out.scores):
            assert scores.shape == (2, V) and scores.dtype == torch.float32
            assert rel_err(scores, step.prediction_scores[:, -1]) < 1e-5
            step = model(out.sequences[:, 3 + n:4 + n], mems=step.mems)
    no_scores = model.generate(x, max_new_tokens=2, return_dict_in_generate=True)
    assert no_scores.scores is None and no_scores.keys() == ["sequences"]


@pytest.mark.parametrize("seed", [1, 2])
def test_xlnet_scores_equal_transformers(seed):
    hf, ours = twins("XLNetLMHeadModel", seed=seed, mem_len=10, initializer_range=0.5)
    x = token_ids(2, 4, seed)
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    theirs, mine = hf.generate(x, **kwargs), ours.generate(x, **kwargs)
    assert mine.sequences.tolist() == theirs.sequences.tolist()
    assert len(mine.scores) == len(theirs.scores) == 6
    for a, b in zip(mine.scores, theirs.scores):
        assert a.shape == b.shape and a.dtype == b.dtype and rel_err(a, b) < 1e-5


def test_sampled_scores_are_the_warped_ones():
    """As transformers' ``output_scores`` when sampling: the scores after temperature and top-k."""
    model, _, _ = txl(seed=9, mem_len=4)
    x = prompt(6)
    out = model.generate(x, max_new_tokens=4, eos_token_id=None, do_sample=True, top_k=3, temperature=0.5,
                         output_scores=True, return_dict_in_generate=True, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        step = model(x, mems=model.init_mems(2))
        for n, scores in enumerate(out.scores):
            raw = step.prediction_scores[:, -1]
            kept = torch.isfinite(scores)
            assert (kept.sum(-1) == 3).all() and torch.equal(kept, raw >= raw.topk(3).values[:, -1:])
            assert rel_err(scores[kept], raw[kept] / 0.5) < 1e-6
            assert kept.gather(1, out.sequences[:, 3 + n:4 + n]).all()  # each drawn token was one of them
            step = model(out.sequences[:, 3 + n:4 + n], mems=step.mems)


@pytest.mark.parametrize("make", ["transfo-xl", "xlnet"])
@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=2), r"num_beams=2: beam search is not supported"),
    (dict(num_return_sequences=2), r"does not support the keyword argument\(s\) 'num_return_sequences'"),
    (dict(max_length=9), r"'max_length' \(pass max_new_tokens"),
    (dict(mem_lenn=3, foo=1), r"'foo', 'mem_lenn'"),
])
def test_unsupported_generate_keywords_are_named(make, kwargs, message):
    model = txl()[0] if make == "transfo-xl" else twins("XLNetLMHeadModel")[1]
    x = prompt(0) if make == "transfo-xl" else token_ids(2, 3)
    with pytest.raises(ValueError, match=message):
        model.generate(x, max_new_tokens=2, **kwargs)
    assert torch.equal(model.generate(x, max_new_tokens=2, num_beams=1), model.generate(x, max_new_tokens=2))
    if make == "xlnet":
        with pytest.raises(ValueError, match="'mems'"):  # Transformer-XL's keyword, not XLNet's
            model.generate(x, max_new_tokens=2, mems=None)


def _recorded_generation():
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "results" / "transfo_xl_generate.json"
    return [r for r in json.loads(path.read_text()) if r["op"] == "transfo_xl_generate"][-1]


def test_greedy_tokens_equal_transformers_4x_recorded_from_both_starts():
    """transformers 4.46's greedy tokens (``python -m bench.transfo_xl_parity --record`` in a
    transformers<5 venv; CI has 5.x, which deleted the model) over a grid of config fields with mem_len
    below the final length: from 4.x's own start (its generate with mems=None) by default, and from
    the original code's empty memory by name. The weights are rebuilt here from the record's seed."""
    from bench.transfo_xl_parity import GENERATE_CONFIGS, STARTS, generation_prompt, seeded_model, weights_digest

    record = _recorded_generation()
    assert record["transformers"].startswith("4.") and record["all_equal"]
    assert [r["config"] for r in record["results"]] == list(GENERATE_CONFIGS)
    for r in record["results"]:
        fields = GENERATE_CONFIGS[r["config"]]
        assert r["fields"] == fields and fields["mem_len"] < r["new_tokens"] + len(r["prompt"][0])
        model = seeded_model(fields, r["seed"], attn_backend="eager")
        assert weights_digest(model) == r["weights_sha256"], (
            f"{r['config']}: the seeded weights are no longer the record's: re-record with "
            "`python -m bench.transfo_xl_parity --record` under transformers<5")
        x = generation_prompt(fields, r["seed"])
        assert x.tolist() == r["prompt"]
        theirs = {start: r["tokens"][start]["transformers_4x"] for start in STARTS}
        assert theirs["zeros"] != theirs["empty"], r["config"]  # the start shows in every configuration
        assert model.generate(x, max_new_tokens=r["new_tokens"], eos_token_id=None).tolist() == theirs["zeros"]
        for start in STARTS:
            mine = model.generate(x, max_new_tokens=r["new_tokens"], eos_token_id=None, mem_start=start)
            assert mine.tolist() == theirs[start], (r["config"], start)
            assert torch.equal(mine, greedy_over_forward(model, x, r["new_tokens"], start=start))
