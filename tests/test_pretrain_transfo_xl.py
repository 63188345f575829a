"""Pretraining Transformer-XL (``xlnet-fast pretrain --model transfo-xl``): the batches against the
original ``LMOrderedIterator``, the loss of a step against the model's forward with the memory
carried, a word-level vocabulary through prepared data, and a tiny run that learns, resumes exactly
(the same loss curve and weights), is evaluated with memory by ``xlnet-fast eval`` (the run's value),
exports a directory ``TransfoXLLMHeadModel.from_pretrained`` loads, generates, stops on SIGTERM
and trains on two ranks as on one."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers.compare import rel_err
from helpers.pretraining import free_port, stopped_after, terminated_after_rows
from helpers.transfo_xl import SMALL, hf4_config, layout_state

from xlnet_fast import TransfoXLConfig, TransfoXLLMHeadModel, TransfoXLTokenizer
from xlnet_fast.cli import main
from xlnet_fast.pretrain import TrainConfig, UsageError, pretrain
from xlnet_fast.pretrain.causal import CausalLMLoss, StreamBatches, forward_flops_per_batch
from xlnet_fast.pretrain.checkpoint import read_model_state
from xlnet_fast.pretrain.corpus import iter_documents, iter_lines
from xlnet_fast.pretrain.objective import CausalLM
from xlnet_fast.pretrain.prepare import prepare_corpus

RUN = dict(model="transfo-xl", preset="tiny", vocab_size=120, tgt_len=16, mem_len=16, batch_size=4,
           backend="eager", progress=False, eval_batches=3)
FLAGS = ["--model", "transfo-xl", "--vocab-size", "120", "--tgt-len", "16", "--mem-len", "16", "--batch-size", "4",
         "--backend", "eager", "--no-progress"]


def run_config(out, corpus, cache, **overrides) -> TrainConfig:
    return TrainConfig(**{**RUN, "data": [corpus], "out": str(out), "cache_dir": str(cache), **overrides})


def command(out, corpus, cache, *extra):
    return [sys.executable, "-m", "xlnet_fast", "pretrain", "--data", corpus, "--out", str(out), "--cache-dir",
            str(cache), *FLAGS, *extra]


def metrics(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def original_lm_ordered_iterator(data: torch.Tensor, bsz: int, bptt: int):
    """The original code's ``LMOrderedIterator`` (``batchify`` then ``get_batch``), batch-first."""
    n_step = data.size(0) // bsz
    data = data[:n_step * bsz].view(bsz, -1).t().contiguous()
    for i in range(0, data.size(0) - 1, bptt):
        seq_len = min(bptt, data.size(0) - 1 - i)
        yield data[i:i + seq_len].t(), data[i + 1:i + 1 + seq_len].t()


@pytest.mark.parametrize("world", [1, 2])
def test_batches_are_the_original_lm_ordered_iterator(world):
    tokens = np.arange(1000, 1000 + 219, dtype=np.int64)  # 6 rows of 36 tokens: 4 segments of 8, then 3
    ranks = [StreamBatches(tokens, tgt_len=8, rows=6 // world, rank=r, world_size=world) for r in range(world)]
    expected = list(original_lm_ordered_iterator(torch.from_numpy(tokens), 6, 8))
    assert len(expected) == 5 and expected[-1][0].shape[1] == 3  # the short tail, which the batches leave out
    for epoch in range(2):  # at the end of its part each row starts over, and says so
        for step, (data, target) in enumerate(expected[:4]):
            parts = [b.next_batch() for b in ranks]
            assert all(p["restart"] == (epoch > 0 and step == 0) for p in parts)
            assert torch.equal(torch.cat([p["input_ids"] for p in parts]), data)
            assert torch.equal(torch.cat([p["labels"] for p in parts]), target)
    with pytest.raises(UsageError, match="too few for 6 rows"):
        StreamBatches(tokens[:50], tgt_len=8, rows=6)


def test_a_step_is_the_models_forward_with_the_memory_carried():
    """The objective's loss of consecutive segments: the summed next-token losses of the model's own
    forward with ``mems`` carried (detached); a restart begins from the start memory again."""
    c = hf4_config(**dict(SMALL, div_val=2, mem_len=5))
    model = TransfoXLLMHeadModel(TransfoXLConfig(**c, attn_backend="eager")).eval()
    model.load_hf_state_dict(layout_state(c, seed=2))
    stream = torch.randint(0, SMALL["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    objective, trainable, mems, ref_mems = CausalLM(), CausalLMLoss(model), None, None
    for start, restart in ((0, False), (4, False), (8, True)):
        ids, labels = stream[:, start:start + 4], stream[:, start + 1:start + 5]
        batch = {"input_ids": ids, "labels": labels, "restart": restart}
        total, count, mems = objective.loss(trainable, batch, mems, None, torch.device("cpu"))
        ref = model(torch.cat([ids, labels[:, -1:]], 1), mems=None if restart else ref_mems,
                    labels=torch.cat([ids, labels[:, -1:]], 1))
        ref_mems = model(ids, mems=None if restart else ref_mems).mems
        assert int(count) == 8 and abs(float(total.detach()) - float(ref.losses.detach().sum())) < 1e-4
        assert all(not m.requires_grad and rel_err(m, r) < 1e-6 for m, r in zip(mems, ref_mems))
    total.backward()  # every parameter takes part (DDP needs it), the empty clusters' too
    assert all(p.grad is not None for p in model.parameters())


def test_flops_of_the_projections_match_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    B, L, M = 2, 6, 5
    fields = dict(SMALL, div_val=1, d_embed=16, cutoffs=[15, 35], mem_len=M)
    model = TransfoXLLMHeadModel(TransfoXLConfig(**fields, attn_backend="eager"))
    with FlopCounterMode(display=False) as counter:  # every target in the head: no tail cluster scored
        out = model.transformer(torch.randint(0, 15, (B, L)), mems=model.init_mems(B))
        model.crit.nll(out.last_hidden_state.reshape(-1, 16), torch.randint(0, 15, (B * L,)))
    A, K = 2 * 8, M + L
    attention = B * 2 * 6 * L * K * A
    total = forward_flops_per_batch(16, 2, 2, 8, 24, L, M, head_size=15 + 2, d_embed=16, rows=B)
    assert counter.get_total_flops() == total - attention


@pytest.mark.parametrize("preset", ["tiny", "small", "base", "large", "shared_r_bias_projected"])
def test_parameter_count_matches_the_model(preset):
    from xlnet_fast.pretrain.flops import transfo_xl_parameter_count
    from xlnet_fast.pretrain.settings import TRANSFO_XL_PRESETS

    if preset == "shared_r_bias_projected":
        fields = dict(vocab_size=60, cutoffs=[15, 35], d_model=16, d_embed=12, n_head=2, d_head=8, d_inner=24,
                      n_layer=3, div_val=1, untie_r=False)
    else:
        fields = dict(vocab_size=TRANSFO_XL_PRESETS[preset]["vocab_size"], **TRANSFO_XL_PRESETS[preset]["model"])
    with torch.device("meta"):
        model = TransfoXLLMHeadModel(TransfoXLConfig(**fields))
    assert transfo_xl_parameter_count(**fields) == model.num_parameters()


def test_word_level_vocabulary_through_prepared_data(corpus, tmp_path, capsys):
    """``tokenizer train --kind word`` and ``data prepare`` with it: each line its symbols and <eos>,
    each document one more <eos> (as the original encodes a corpus), whatever the workers."""
    vocab = tmp_path / "vocab"
    assert main(["tokenizer", "train", corpus, "--kind", "word", "--vocab-size", "20", "--out", str(vocab)]) == 0
    tok = TransfoXLTokenizer.from_pretrained(vocab)
    assert tok.vocab_size == 20 and tok.idx2sym[:2] == ["<eos>", "<unk>"] and tok.moses is False
    assert tok.tokenize("let there be light.") == ["let", "there", "be", "light", "."]  # marks on their own
    whole = TransfoXLTokenizer.from_corpus(["god said, let there be light."])
    assert whole.decode(whole.encode("god said, let there be light.")) == "god said, let there be light."
    counts = {}
    for line in iter_lines([corpus]):
        for w in line.replace(".", " .").replace(",", " ,").split():
            counts[w] = counts.get(w, 0) + 1
    assert tok.idx2sym[2:] == sorted(counts, key=lambda w: -counts[w])[:18]  # most frequent first (stable)
    expected = [i for doc in iter_documents([corpus]) for i in
                [j for line in doc for j in tok.encode(line, add_eos=True)] + [tok.eos_id]]
    for workers in (1, 2):
        data = prepare_corpus([corpus], tok, tmp_path / f"data{workers}", workers=workers, shard_tokens=5000,
                              chunk_bytes=4096)
        assert np.array_equal(np.asarray(data[:]), expected)
    assert main(["data", "prepare", corpus, "--tokenizer", str(vocab), "--out", str(tmp_path / "cli"),
                 "--no-progress"]) == 0
    capsys.readouterr()
    # XLNet needs its sentencepiece ids: a word-level vocabulary is refused in one line
    assert main(["pretrain", "--data", str(tmp_path / "cli"), "--out", str(tmp_path / "x"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "word-level vocabulary" in err[0] and "--model xlnet" in err[0], err


@pytest.fixture(scope="module")
def txl_run(corpus, tmp_path_factory):
    """A tiny run of 12 steps with dropout, checkpoints at 6 and 12, evaluations at 6 and 12."""
    root = tmp_path_factory.mktemp("txl_run")
    res = pretrain(run_config(root / "run", corpus, root / "cache", steps=12, save_every=6, keep=5, eval_every=6,
                              lr=5e-3, warmup=2, dropout=0.1))
    return root, res


def test_tiny_run_learns_and_evaluates_with_memory(txl_run, corpus, capsys):
    root, res = txl_run
    train, evals = metrics(root / "run")
    assert [r["step"] for r in train] == list(range(1, 13)) and [r["step"] for r in evals] == [6, 12]
    vocab = TransfoXLTokenizer.from_pretrained(res["checkpoint"]).vocab_size  # the test corpus: about 30 words
    assert train[-1]["loss"] < train[0]["loss"] - 0.3 and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[1]["eval_loss"] < np.log(vocab) - 0.1  # better than a uniform guess, on held-out text
    assert res["model_class"] == "TransfoXLLMHeadModel" and train[0]["tokens"] == 4 * 16
    assert os.path.exists(root / "run" / "loss.png") or res["plot"] is None or "matplotlib" in str(res["plot"])
    # xlnet-fast eval on the run: the run's evaluation, the same value as its metrics row
    assert main(["eval", "--model", str(root / "run"), "--cache-dir", str(root / "cache"), "--backend", "eager"]) == 0
    out, err = capsys.readouterr()
    (line,) = out.splitlines()  # stdout: the JSON line only; the progress bar of the segments on stderr
    row = json.loads(line)
    assert "eval: 100%" in err and f"{row['batches']}/{row['batches']}" in err and "segment" in err, err
    assert row["step"] == 12 and row["eval_tokens"] == evals[1]["eval_tokens"] > 0 and row["eval_tokens"] % 64 == 0
    assert row["eval_loss"] == pytest.approx(evals[1]["eval_loss"], rel=1e-6)
    # ... with longer memory, on the same text
    assert main(["eval", "--model", str(root / "run"), "--cache-dir", str(root / "cache"), "--mem-len", "48",
                 "--backend", "eager", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    longer = json.loads(out)
    assert "eval:" not in err, err
    assert longer["mem_len"] == 48 and longer["eval_tokens"] == row["eval_tokens"]
    assert main(["eval", "--model", str(root / "run"), "--seq-len", "8"]) == 2
    assert "--seq-len: XLNet's record layout" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--tgt-len", "--batch-size", "--batches"])
def test_eval_of_a_run_refuses_zero_as_it_does_for_other_models(txl_run, flag, capsys):
    """``eval`` of a Transformer-XL run took 0 for "not given" (``x or default``): --tgt-len 0 printed
    the run's tgt_len; an XLNet's eval and a Transformer-XL directory's refuse it."""
    root, _ = txl_run
    assert main(["eval", "--model", str(root / "run"), "--cache-dir", str(root / "cache"), flag, "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} must be a positive integer, got 0" in err[0], err


def test_eval_of_a_run_refuses_a_tokenizer_of_another_vocabulary(txl_run, corpus, tmp_path, capsys):
    """A tokenizer smaller than the model's vocabulary (the run's own less its last words) was taken
    and gave a loss over other ids; ``generate`` refuses any other size, and now ``eval`` too."""
    root, res = txl_run
    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(os.path.join(res["checkpoint"], "tokenizer_config.json"), tok)
    words = open(os.path.join(res["checkpoint"], "vocab.txt"), encoding="utf-8").read().splitlines()
    (tok / "vocab.txt").write_text("\n".join(words[:-3]) + "\n", encoding="utf-8")
    assert main(["eval", "--model", str(root / "run"), "--cache-dir", str(root / "cache"), "--tokenizer", str(tok),
                 "--data", corpus, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"has {len(words) - 3} symbols but the model's vocabulary {len(words)}" in err[0], err


def test_tiny_run_resumes_exactly(txl_run, corpus):
    """Stopped after its step-6 checkpoint and resumed — with activation checkpointing, which must
    change nothing (its recomputation redraws the same dropout masks): the same losses and weights."""
    root, _ = txl_run
    stopped_after(root / "run", 6, root / "other")
    pretrain(run_config(root / "other", corpus, root / "cache", steps=12, save_every=6, keep=5, eval_every=6,
                        lr=5e-3, warmup=2, dropout=0.1, resume=True, checkpointing=True))
    ref, got = metrics(root / "run"), metrics(root / "other")
    for a, b in zip(got[0] + got[1], ref[0] + ref[1], strict=True):
        key = "eval_loss" if "eval_loss" in a else "loss"
        assert a["step"] == b["step"] and a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a, b)
    w_ref = read_model_state(str(root / "run" / "checkpoints" / "step_0000012"))
    w_got = read_model_state(str(root / "other" / "checkpoints" / "step_0000012"))
    for k in w_ref:
        torch.testing.assert_close(w_got[k], w_ref[k], rtol=1e-6, atol=1e-7)


def test_export_loads_and_generates(txl_run, capsys):
    root, res = txl_run
    out = root / "export"
    assert main(["export", str(root / "run"), "--out", str(out)]) == 0
    assert "xlnet_fast.TransfoXLLMHeadModel.from_pretrained" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer_config.json", "vocab.txt"]
    model = TransfoXLLMHeadModel.from_pretrained(out)
    state = read_model_state(res["checkpoint"])
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items())
    assert model.config.mem_len == 16 and model.config.eos_token_id == 0
    assert main(["generate", "--model", str(out), "--prompt", "god created", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("god created")
    assert main(["generate", "--model", str(root / "run"), "--prompt", "god created", "--max-new-tokens", "4",
                 "--mem-start", "empty"]) == 0  # a run directory too


@pytest.mark.parametrize("extra, message", [
    (["--reuse-len", "8"], "--reuse-len: not a setting of --model transfo-xl"),
    (["--tgt-len", "0"], "--tgt-len must be a positive integer, got 0"),
    (["--preset", "small", "--mem-len", "0", "--same-length"], "--same-length makes every token attend"),
])
def test_mistakes_are_one_line(corpus, tmp_path, extra, message, capsys):
    assert main(command(tmp_path / "run", corpus, tmp_path / "cache", *extra)[3:]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xlnet-fast: error: ") and message in err[0], err


def test_sigterm_saves_and_a_resume_cannot_change_the_model(corpus, tmp_path):
    returncode, out = terminated_after_rows(command(tmp_path / "run", corpus, tmp_path / "cache", "--steps", "100000"),
                                            tmp_path / "run" / "metrics.jsonl", 2)
    assert returncode == 0 and "pretrain stopped by SIGTERM" in out, out
    step = int(sorted((tmp_path / "run" / "checkpoints").iterdir())[-1].name.split("_")[1])
    res = subprocess.run(command(tmp_path / "run", corpus, tmp_path / "cache", "--steps", str(step + 1), "--resume"),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    other = command(tmp_path / "run", corpus, tmp_path / "cache", "--resume", "--steps", str(step + 2))
    other[other.index("transfo-xl")] = "xlnet"
    del other[other.index("--tgt-len"):other.index("--tgt-len") + 2]
    res = subprocess.run(other, capture_output=True, text=True)
    assert res.returncode == 2 and "--model xlnet differs from the checkpoint's transfo-xl" in res.stderr, res.stderr


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_rank_update_equals_one_rank_with_double_batch(corpus, tmp_path, sharding):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--steps", "2", "--dropout", "0", "--seed", "3"]
    one = command(tmp_path / "one", corpus, tmp_path / "cache", *common)
    two = command(tmp_path / "two", corpus, tmp_path / "cache", *common)
    two[two.index("--batch-size") + 1] = "2"
    two[1:3] = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m",
                "xlnet_fast"]
    if sharding == "fsdp":
        two.append("--fsdp")
    for cmd in (one, two):
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
    w1 = read_model_state(str(tmp_path / "one" / "checkpoints" / "step_0000002"))
    w2 = read_model_state(str(tmp_path / "two" / "checkpoints" / "step_0000002"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-6)
    evals = [metrics(tmp_path / d)[1][-1] for d in ("one", "two")]
    assert evals[1]["eval_tokens"] == evals[0]["eval_tokens"]
    assert evals[1]["eval_loss"] == pytest.approx(evals[0]["eval_loss"], rel=1e-4)
