"""``xlnet-fast generate`` (Transformer-XL and XLNet directories) and ``xlnet-fast eval`` on a
Transformer-XL directory: the output, the flags, and a user's mistake as one line with exit status 2."""

import json
import math

import pytest
from helpers.pretraining import write_corpus
from helpers.transfo_xl import SMALL, write_hf4_dir

from xlnet_fast import XLNetConfig, XLNetLMHeadModel
from xlnet_fast.cli import main
from xlnet_fast.pretrain.corpus import iter_lines
from xlnet_fast.pretrain.tokenizer import train_tokenizer
from xlnet_fast.transfo_xl import TransfoXLLMHeadModel
from xlnet_fast.transfo_xl.evaluate import encode_files, stream_nll
from xlnet_fast.transfo_xl.tokenizer import TransfoXLTokenizer


@pytest.fixture(scope="module")
def txl_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("txl")
    write_hf4_dir(path, dict(SMALL, vocab_size=8, cutoffs=[4], mem_len=6))
    (path / "vocab.txt").write_text("<eos>\n<unk>\nthe\ncat\nsat\non\nmat\n.\n")
    text = path / "text.txt"
    text.write_text("the cat sat on the mat .\n\nthe mat sat on the cat .\n" * 4)
    return str(path), str(text)


def test_eval_command_prints_the_perplexity(txl_dir, capsys):
    path, text = txl_dir
    assert main(["eval", "--model", path, "--data", text, "--tgt-len", "5", "--mem-len", "7", "--clamp-len", "3",
                 "--same-length", "--batch-size", "2", "--backend", "eager"]) == 0
    out, err = capsys.readouterr()
    (line,) = out.splitlines()  # stdout: the JSON line only; the progress bar of the 7 segments on stderr
    row = json.loads(line)
    assert "eval: 100%" in err and "7/7" in err and "segment" in err, err
    assert row["tokens"] == (4 * 17 // 2 - 1) * 2  # 7 + 1 + 1 + 7 + 1 symbols and <eos>s per repetition, 2 rows
    assert row["mem_len"] == 7 and row["clamp_len"] == 3 and row["same_length"] is True and row["tgt_len"] == 5
    assert math.isclose(row["ppl"], math.exp(row["loss"]))
    model = TransfoXLLMHeadModel.from_pretrained(path, mem_len=7, clamp_len=3, same_length=True)
    r = stream_nll(model, encode_files([text], TransfoXLTokenizer.from_pretrained(path)), 5, 2)
    assert math.isclose(row["loss"], r["loss_sum"] / r["tokens"], rel_tol=1e-9)
    assert r["segments"] == 7 and capsys.readouterr().err == ""  # no bar unless asked (progress=True)
    assert main(["eval", "--model", path, "--data", text, "--tgt-len", "5", "--batch-size", "2", "--batches", "3",
                 "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["segments"] == 3 and "eval:" not in err, err


@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "8"], "--seq-len: XLNet's record layout"),
    # regression: the checkpoint and prepared-data checks do not apply to a Transformer-XL directory
    (["--no-verify"], "--no-verify: XLNet's record layout, checkpoint"),
    (["--verify-data"], "--verify-data: XLNet's"),
    (["--tgt-len", "0"], "--tgt-len must be a positive integer, got 0"),
    (["--mem-len", "-1"], "--mem-len must be 0 or a positive integer"),
    (["--batch-size", "50"], "too few for 50 rows"),
    (["--mem-len", "0", "--same-length"], "same_length=True makes every token attend"),
])
def test_eval_command_mistakes_are_one_line(txl_dir, capsys, extra, message):
    path, text = txl_dir
    assert main(["eval", "--model", path, "--data", text, *extra]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and message in errors[0], errors  # (a log line may precede it: no traceback)


def test_eval_command_needs_data_and_rejects_transfo_xl_flags_for_xlnet(txl_dir, tmp_path, capsys):
    path, _ = txl_dir
    assert main(["eval", "--model", path]) == 2
    assert "--data FILE... is needed" in capsys.readouterr().err
    XLNetLMHeadModel(XLNetConfig(vocab_size=20, d_model=8, n_layer=1, n_head=2, d_inner=8)).save_pretrained(tmp_path)
    assert main(["eval", "--model", str(tmp_path), "--tgt-len", "4"]) == 2
    assert "--tgt-len: Transformer-XL flags" in capsys.readouterr().err


def test_generate_command(txl_dir, tmp_path, capsys):
    path, _ = txl_dir
    assert main(["generate", "--model", path, "--prompt", "the cat", "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    words = out.split()
    assert words[:2] == ["the", "cat"] and len(words) <= 7
    assert "new tokens after a 2-token prompt" in err and "memory of 6 rows" in err
    assert main(["generate", "--model", path, "--prompt", "the", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be a positive integer" in capsys.readouterr().err
    assert main(["generate", "--model", path, "--prompt", "the", "--sample", "--top-p", "2"]) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "nothing"), "--prompt", "the"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_generate_command_on_an_xlnet_directory(tmp_path, capsys):
    tok = train_tokenizer(iter_lines([write_corpus(tmp_path / "text.txt", docs=4)]), 120, tmp_path / "xlnet")
    XLNetLMHeadModel(XLNetConfig(vocab_size=tok.vocab_size, d_model=16, n_layer=1, n_head=2, d_inner=16,
                                 initializer_range=0.5)).save_pretrained(tmp_path / "xlnet")
    assert main(["generate", "--model", str(tmp_path / "xlnet"), "--prompt", "in the beginning",
                 "--max-new-tokens", "4", "--sample", "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("in the beginning") and "XLNet: " in err and "new tokens" in err
