"""Pretraining as people run it: held-out evaluation, `xlnet-fast eval`, FLOPs and MFU, the end-of-run
summary (also after SIGTERM), the loss plot, the help text, `--version`, the cache variable and
`xlnet-fast export`."""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from helpers.pretraining import reference_tokens, write_corpus

from xlnet_fast import XLNetConfig, XLNetLMHeadModel, XLNetTokenizer, __version__
from xlnet_fast.cli import build_parser, main
from xlnet_fast.pretrain import TrainConfig, pretrain
from xlnet_fast.pretrain.corpus import iter_lines
from xlnet_fast.pretrain.data import DataConfig
from xlnet_fast.pretrain.evaluate import EVAL_SEED, Evaluator, heldout_length, split_heldout
from xlnet_fast.pretrain.flops import (PEAK_TFLOPS_ENV, StepShape, Throughput, device_peak_tflops,
                                       forward_flops_per_batch, parameter_count, training_flops_per_step)
from xlnet_fast.pretrain.settings import PRESETS
from xlnet_fast.pretrain.tokenizer import train_tokenizer
from xlnet_fast.pretrain.checkpoint import load_model_weights

LAYOUT = ["--vocab-size", "120", "--seq-len", "32", "--reuse-len", "16", "--mem-len", "16", "--num-predict", "6",
          "--perm-size", "8", "--batch-size", "4", "--backend", "eager"]


def checkpoint_model(path, **config_overrides) -> XLNetLMHeadModel:
    """A training checkpoint's model (sharded: read through load_model_weights), in eval mode."""
    model = XLNetLMHeadModel(XLNetConfig.from_pretrained(str(path), **config_overrides))
    load_model_weights(model, str(path))
    return model.eval()


@pytest.fixture(scope="module")
def other_text(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("other") / "other.txt", seed=5, docs=8)


def cfg(out, corpus, cache, **kw):
    base = dict(preset="tiny", data=[corpus], out=str(out), cache_dir=cache, vocab_size=120, seq_len=32,
                reuse_len=16, mem_len=16, num_predict=6, perm_size=8, batch_size=4, steps=4, progress=False,
                backend="eager", eval_batches=3)
    base.update(kw)
    return TrainConfig(**base)


def rows_of(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def cli(*args):
    return [sys.executable, "-m", "xlnet_fast", *args]


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus, cache):
    """A finished CLI run, as a user starts it (progress bar on): 4 steps, evaluated every step,
    checkpoints at steps 2 and 4. Returns (run dir, stdout, stderr)."""
    out = tmp_path_factory.mktemp("cli") / "run"
    res = subprocess.run(cli("pretrain", "--data", corpus, "--out", str(out), "--cache-dir", cache, *LAYOUT,
                             "--steps", "4", "--eval-every", "1", "--eval-batches", "3", "--save-every", "2",
                             "--keep", "5"), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    return out, res.stdout, res.stderr


# ---------------------------------------------------------------------------------------------
# Held-out evaluation
# ---------------------------------------------------------------------------------------------


def test_eval_rows_are_deterministic_and_do_not_disturb_training(corpus, cache, tmp_path):
    """Evaluating every step changes nothing in training (dropout on: the RNG is untouched), and the
    evaluation of the same weights is the same value in another run."""
    pretrain(cfg(tmp_path / "every", corpus, cache, eval_every=1, dropout=0.1))
    pretrain(cfg(tmp_path / "end", corpus, cache, eval_every=0, dropout=0.1))
    train_every, evals_every = rows_of(tmp_path / "every")
    train_end, evals_end = rows_of(tmp_path / "end")
    assert [r["loss"] for r in train_every] == [r["loss"] for r in train_end]
    assert [r["step"] for r in evals_every] == [1, 2, 3, 4] and [r["step"] for r in evals_end] == [4]
    assert evals_every[-1] == evals_end[-1]
    for row in evals_every:
        assert set(row) == {"step", "eval_loss", "eval_ppl", "eval_tokens"}
        assert row["eval_ppl"] == pytest.approx(math.exp(row["eval_loss"]))
        assert 0 < row["eval_tokens"] <= 3 * 4 * 6 and math.isfinite(row["eval_loss"])
    assert len({r["eval_loss"] for r in evals_every}) == 4  # the weights changed between them


def test_held_out_tail_is_fixed_and_said(corpus, cache, tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        pretrain(cfg(tmp_path / "run", corpus, cache, steps=1))
    assert "holding out the last 256 of" in caplog.text and "--eval-data" in caplog.text
    assert heldout_length(13304, 32, 4) == 4 * 2 * 32  # ~1% is below the minimum of 2 sequences a row
    assert heldout_length(10**6, 32, 4) == 4 * 32 * 32  # ... and 1% of this is above the maximum of 32
    assert heldout_length(40_000, 32, 4) == 100 * 4
    tokens = np.arange(1000)
    train, held = split_heldout(tokens, 32, 4)
    assert len(held) == 256 and np.array_equal(np.concatenate([train, held]), tokens)
    from xlnet_fast.pretrain import UsageError

    with pytest.raises(UsageError, match="corpus too small.*--eval-data"):
        split_heldout(np.arange(400), 32, 4)


def test_eval_data_trains_on_everything(corpus, other_text, cache, tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        pretrain(cfg(tmp_path / "run", corpus, cache, steps=1, eval_data=[other_text]))
    assert "holding out" not in caplog.text and f"--eval-data {other_text}" in caplog.text
    with open(tmp_path / "run" / "checkpoints" / "step_0000001" / "run.json") as f:
        settings = json.load(f)["settings"]
    assert settings["hold_out"] is False and settings["eval_data"] == [other_text]


def test_eval_value_does_not_depend_on_the_split_over_ranks(corpus, cache, tmp_path):
    tok = train_tokenizer(iter_lines([corpus]), 120, tmp_path / "tok")
    tokens = reference_tokens([corpus], tok)
    model = XLNetLMHeadModel(XLNetConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=2, n_head=4, d_inner=64,
                                         mem_len=16, reuse_len=16, attn_backend="eager"))
    layout = DataConfig(seq_len=32, reuse_len=16, num_predict=6, perm_size=8)
    one = Evaluator(tokens, tok, layout, rows=4, n_batches=3, mem_len=16).sums(model, torch.device("cpu"))
    parts = [Evaluator(tokens, tok, layout, rows=2, n_batches=3, mem_len=16, rank=r, world=2).sums(
        model, torch.device("cpu")) for r in range(2)]
    assert one[1] == sum(p[1] for p in parts)
    assert one[0] == pytest.approx(sum(p[0] for p in parts), rel=1e-9)
    again = Evaluator(tokens, tok, layout, rows=4, n_batches=3, mem_len=16)
    assert again.sums(model, torch.device("cpu")) == again.sums(model, torch.device("cpu")) == one
    assert again.batches.cfg.seed == EVAL_SEED


# ---------------------------------------------------------------------------------------------
# `xlnet-fast eval`
# ---------------------------------------------------------------------------------------------


def eval_json(capsys, *args):
    assert main(["eval", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_command_prints_the_runs_eval_loss(run, cache, capsys):
    out, _, _ = run
    _, evals = rows_of(out)
    last = eval_json(capsys, "--model", str(out), "--cache-dir", cache)  # the run dir: its newest checkpoint
    assert last["step"] == 4 and last["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-9)
    assert last["eval_tokens"] == evals[-1]["eval_tokens"]
    step2 = eval_json(capsys, "--model", str(out / "checkpoints" / "step_0000002"), "--cache-dir", cache)
    assert step2["step"] == 2 and step2["eval_loss"] == pytest.approx(evals[1]["eval_loss"], rel=1e-9)


def test_eval_command_on_a_transformers_directory(run, cache, other_text, tmp_path, capsys):
    """Our checkpoint and transformers' save_pretrained of it give the same value on given text."""
    transformers = pytest.importorskip("transformers")
    out, _, _ = run
    ckpt = out / "checkpoints" / "step_0000004"
    checkpoint_model(ckpt).save_pretrained(str(tmp_path / "ours"))
    transformers.XLNetLMHeadModel.from_pretrained(str(tmp_path / "ours")).save_pretrained(str(tmp_path / "hf"))
    flags = ["--data", other_text, "--cache-dir", cache, "--batches", "2"]
    ours = eval_json(capsys, "--model", str(ckpt), *flags)
    layout = ["--seq-len", "32", "--reuse-len", "16", "--mem-len", "16", "--num-predict", "6", "--perm-size", "8",
              "--batch-size", "4"]
    theirs = eval_json(capsys, "--model", str(tmp_path / "hf"), "--tokenizer", str(ckpt), *flags, *layout)
    assert theirs["step"] is None and theirs["eval_tokens"] == ours["eval_tokens"]
    assert theirs["eval_loss"] == pytest.approx(ours["eval_loss"], rel=1e-5)
    assert main(["eval", "--model", str(tmp_path / "hf"), "--tokenizer", str(ckpt), "--cache-dir", cache]) == 2
    assert "--data" in capsys.readouterr().err


def test_eval_command_errors_are_one_line(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model" in err[0] and "not a directory" in err[0]
    (tmp_path / "empty").mkdir()
    assert main(["eval", "--model", str(tmp_path / "empty")]) == 2
    assert "no config.json" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# FLOPs and MFU
# ---------------------------------------------------------------------------------------------


def test_flops_against_a_hand_count():
    """One layer, one record: every matrix product written out (2 FLOPs a multiply-add)."""
    d, H, D, F, V, L, M, P = 8, 2, 4, 16, 10, 4, 2, 3
    K, R = M + L, M + 2 * L
    s = StepShape(d_model=d, n_layer=1, n_head=H, d_head=D, d_inner=F, vocab_size=V, seq_len=L, mem_len=M,
                  num_predict=P, rows=1)
    content = (2 * L * d * H * D  # q = h W_q
               + 2 * K * d * H * D * 2  # k, v over [mems, h]
               + 2 * L * K * H * D  # q k^T
               + 2 * L * K * H * D  # q k_r^T (shifted: one per key)
               + 2 * L * K * H * D  # p v
               + 2 * L * H * D * d  # o
               + 2 * L * d * F + 2 * L * F * d)  # feed-forward
    query = (2 * P * d * H * D + 3 * 2 * P * K * H * D + 2 * P * H * D * d + 2 * P * d * F + 2 * P * F * d)
    head = 2 * P * d * V
    positions = 2 * R * d * H * D
    forward = content + query + head + positions
    assert forward_flops_per_batch(s) == forward
    assert training_flops_per_step(s, grad_accum=2, world=3) == 3 * forward * 2 * 3
    bi = StepShape(**{**s.__dict__, "bi_data": True, "rows": 2})
    assert forward_flops_per_batch(bi) == 2 * (content + query + head) + 2 * positions
    meter = Throughput(tokens_per_step=100, flops_per_step=3 * forward, world=1, peak_tflops=1e-6)
    rates = meter.step(0.5)
    assert rates["tokens_per_s"] == pytest.approx(200)
    assert rates["mfu"] == pytest.approx(3 * forward / 0.5 / 1e6)
    assert Throughput(100, 3 * forward, 1, None).step(0.5).keys() == {"tokens_per_s"}


def test_flops_of_the_projections_match_torch_flop_counter():
    """Everything but the attention op (a custom op the counter does not see) against the model's
    own matrix products."""
    from torch.utils.flop_counter import FlopCounterMode

    B, L, M, P = 2, 16, 8, 4
    config = XLNetConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, d_inner=64, attn_backend="eager",
                         mem_len=M, reuse_len=8)
    model = XLNetLMHeadModel(config)
    q_rank = torch.stack([torch.randperm(L) for _ in range(B)]).int()
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(9, 50, (B, L)), q_rank=q_rank, k_rank=q_rank, mems=[torch.randn(M, B, 32)] * 2,
              target_pos=torch.stack([torch.randperm(L)[:P] for _ in range(B)]), use_mems=True)
    s = StepShape(d_model=32, n_layer=2, n_head=4, d_head=8, d_inner=64, vocab_size=50, seq_len=L, mem_len=M,
                  num_predict=P, rows=B)
    attention = 2 * B * 6 * 32 * (M + L) * (L + P)
    assert counter.get_total_flops() == forward_flops_per_batch(s) - attention


def test_parameter_count_matches_the_model():
    sizes = PRESETS["tiny"]["model"]
    model = XLNetLMHeadModel(XLNetConfig(vocab_size=2000, **sizes))
    assert parameter_count(vocab_size=2000, **sizes) == model.num_parameters()


def test_device_peaks(monkeypatch):
    monkeypatch.delenv(PEAK_TFLOPS_ENV, raising=False)
    peak, note = device_peak_tflops(torch.device("cpu"))
    assert peak is None and "not meaningful" in note
    names = {"NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.5, "NVIDIA H100 NVL": 835.5,
             "NVIDIA H200": 989.4, "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA L4": 121.0, "NVIDIA L40S": 362.05}
    for name, expected in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert device_peak_tflops(torch.device("cuda", 0))[0] == expected, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10G")
    peak, note = device_peak_tflops(torch.device("cuda", 0))
    assert peak is None and "unknown" in note and "--peak-tflops" in note
    assert device_peak_tflops(torch.device("cuda", 0), override=100.0)[0] == 100.0
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "250")
    assert device_peak_tflops(torch.device("cpu"))[0] == 250.0
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "fast")
    assert device_peak_tflops(torch.device("cpu"))[0] is None


# ---------------------------------------------------------------------------------------------
# The summary, the progress bar, the plot
# ---------------------------------------------------------------------------------------------


def test_summary_at_the_end(run):
    out, stdout, _ = run
    train, evals = rows_of(out)
    for expected in ("pretrain finished at step 4 of 4", "512 tokens seen (128 per step)", "this session 4 steps in",
                     "tokens/s", "MFU is not meaningful on a CPU", f"eval loss: {evals[-1]['eval_loss']:.4f}",
                     f"checkpoints: {out / 'checkpoints'} (newest: step_0000004)",
                     f"load_model_weights(model, '{out / 'checkpoints' / 'step_0000004'}')",
                     f"xlnet-fast pretrain --out {out} --resume", f"xlnet-fast export {out}"):
        assert expected in stdout, expected
    w = 1  # 4 rows: means of 1 row
    first, last = train[0]["loss"], train[-1]["loss"]
    assert f"training loss: {first:.4f} -> {last:.4f} (means of the first and last {w}" in stdout
    assert all("tokens" in r and "tokens_per_s" in r and "mfu" not in r for r in train)


def test_log_lines_never_land_inside_the_progress_bar(run):
    _, _, stderr = run
    assert "pretrain:" in stderr  # the bar was drawn
    starts = [i for i in range(len(stderr)) if stderr.startswith("INFO xlnet_fast.pretrain.loop: step", i)]
    assert len(starts) == 4  # the four evaluations, logged while the bar was open
    assert all(i == 0 or stderr[i - 1] in "\r\n" for i in starts)


def test_summary_after_sigterm(corpus, cache, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(cli("pretrain", "--data", corpus, "--out", str(out), "--cache-dir", cache, *LAYOUT,
                                "--steps", "100000", "--eval-every", "2", "--eval-batches", "1", "--no-progress"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or "eval_loss" not in metrics.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    _, evals = rows_of(out)
    assert "pretrain stopped by SIGTERM at step" in stdout and "of 100000" in stdout
    assert f"eval loss: {evals[-1]['eval_loss']:.4f}" in stdout
    assert f"xlnet-fast pretrain --out {out} --resume" in stdout and "training loss:" in stdout


def test_plot(run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, stdout, _ = run
    png = out / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in stdout  # drawn at the end
    assert main(["plot", str(out), "--out", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 10_000
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert f"{tmp_path / 'empty' / 'metrics.jsonl'} does not exist" in capsys.readouterr().err
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path / "empty")]) == 2
    assert "no training rows" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Help, --version, the cache directory
# ---------------------------------------------------------------------------------------------


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from ((f"{name} {n}", s) for n, s in _subparsers(sub))


def test_every_flag_says_its_default():
    commands = dict(_subparsers(build_parser()))
    assert {"info", "pretrain", "eval", "plot", "export", "tokenizer train"} <= set(commands)
    for name, sub in commands.items():
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            text = action.help or ""
            assert "default" in text or "required" in text, (name, action.option_strings or action.dest)
    pretrain_help = commands["pretrain"].format_help()
    for preset in PRESETS:
        assert f"  {preset} " in pretrain_help
    assert "0.6M" in pretrain_help and "116.8M" in pretrain_help  # parameters of tiny and base


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"xlnet-fast {__version__}"


def test_cache_directory_from_the_environment(monkeypatch, tmp_path):
    from xlnet_fast.pretrain.outputs import CACHE_ENV
    from xlnet_fast.pretrain.run_dir import cache_root

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "elsewhere"))
    assert cache_root(TrainConfig()) == str(tmp_path / "elsewhere")
    assert cache_root(TrainConfig(cache_dir="given")) == "given"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_root(TrainConfig()) == os.path.join(os.path.expanduser("~"), ".cache", "xlnet_fast")


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def test_export_loads_in_transformers_with_our_logits(run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out, _, _ = run
    dest = tmp_path / "export"
    assert main(["export", str(out), "--out", str(dest)]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    assert sorted(os.listdir(dest)) == ["config.json", "model.safetensors", "spiece.model", "tokenizer.json",
                                        "tokenizer_config.json"]
    ours = checkpoint_model(out / "checkpoints" / "step_0000004", attn_backend="eager")
    theirs = transformers.XLNetLMHeadModel.from_pretrained(str(dest)).eval()
    exported = XLNetLMHeadModel.from_pretrained(str(dest), attn_backend="eager")
    L = 12
    ids = torch.randint(9, ours.config.vocab_size, (2, L))
    perm_mask = (torch.rand(2, L, L) < 0.5).float()
    target_mapping = torch.zeros(2, 3, L)
    target_mapping[:, torch.arange(3), torch.tensor([2, 5, 9])] = 1
    with torch.no_grad():
        ref = ours(ids, perm_mask=perm_mask, target_mapping=target_mapping).logits
        torch.testing.assert_close(theirs(ids, perm_mask=perm_mask, target_mapping=target_mapping).logits, ref,
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(exported(ids, perm_mask=perm_mask, target_mapping=target_mapping).logits, ref)
    tok = transformers.AutoTokenizer.from_pretrained(str(dest))
    ours_tok = XLNetTokenizer.from_pretrained(str(dest))
    assert tok("god created heaven")["input_ids"] == ours_tok("god created heaven")["input_ids"]


def test_export_dtype_and_refusals(run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out, _, _ = run
    dest = tmp_path / "export"
    assert main(["export", str(out / "checkpoints" / "step_0000002"), "--out", str(dest), "--dtype", "bf16"]) == 0
    model = transformers.XLNetLMHeadModel.from_pretrained(str(dest), dtype=torch.bfloat16)
    ours = checkpoint_model(out / "checkpoints" / "step_0000002")
    assert model.transformer.word_embedding.weight.dtype == torch.bfloat16
    assert torch.equal(model.transformer.word_embedding.weight, ours.transformer.word_embedding.weight.bfloat16())
    assert ".to(torch.bfloat16)" in capsys.readouterr().out  # transformers keeps XLNet's q, k, v, o, r in float32
    ids = torch.randint(9, ours.config.vocab_size, (1, 10))
    with torch.no_grad():
        logits = model.to(torch.bfloat16)(ids).logits
        torch.testing.assert_close(logits.float(), ours(ids).logits, rtol=0.1, atol=0.1)
    before = (dest / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["export", str(out), "--out", str(dest)]) == 2  # not empty
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overwrite" in err[0]
    assert (dest / "model.safetensors").read_bytes() == before
    assert main(["export", str(out), "--out", str(dest), "--overwrite"]) == 0
    assert (dest / "model.safetensors").read_bytes() != before
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary left behind
    (tmp_path / "file").write_text("x")
    assert main(["export", str(out), "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err
