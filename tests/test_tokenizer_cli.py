"""Tokenizer conventions, training with XLNet's ids, and the CLI."""

import random
import subprocess
import sys

import pytest
import torch

from xlnet_fast import XLNetTokenizer, train_tokenizer
from xlnet_fast.cli import main
from xlnet_fast.pretrain.tokenizer import CLS_ID, PAD_ID, SEP_ID, SPECIAL_TOKENS


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    rng = random.Random(0)
    words = "in the beginning god created heaven and earth light was good 9, 10 day night".split()
    lines = [" ".join(rng.choice(words) for _ in range(10)) for _ in range(3000)]
    return train_tokenizer(lines, 60, tmp_path_factory.mktemp("spm"))


def test_trained_model_has_xlnet_special_ids(tok):
    assert tok.convert_ids_to_tokens(range(9)) == SPECIAL_TOKENS


def test_pair_layout_segments_and_left_padding(tok):
    enc = tok(["god created", "light was good and the earth"], ["heaven", "day"], padding=True, return_tensors="pt")
    ids, types, att = enc["input_ids"], enc["token_type_ids"], enc["attention_mask"]
    assert ids.shape == types.shape == att.shape and ids.dtype == torch.long
    for row in range(2):
        n = int(att[row].sum())
        real, real_types = ids[row, -n:].tolist(), types[row, -n:].tolist()
        assert real[-1] == CLS_ID and real_types[-1] == 2
        seps = [i for i, t in enumerate(real) if t == SEP_ID]
        assert len(seps) == 2 and seps[1] == n - 2
        assert set(real_types[: seps[0] + 1]) == {0}
        assert set(real_types[seps[0] + 1: seps[1] + 1]) == {1}
        assert ids[row, : ids.shape[1] - n].eq(PAD_ID).all()
    assert att[0, 0] == 0  # the shorter row is padded on the left


def test_decode_round_trip(tok):
    text = "in the beginning god created heaven and earth"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert tok.decode(tok.encode(text)) == text + "<sep><cls>"


def test_digit_comma_split(tok):
    pieces = tok.tokenize("day 9, night")
    assert "," in pieces and not any(p.endswith(",") and len(p) > 1 and p[-2].isdigit() for p in pieces)


def test_truncation_keeps_special_tokens(tok):
    ids = tok.encode("god " * 50, "earth " * 50, max_length=16, truncation=True)
    assert len(ids) == 16 and ids[-1] == CLS_ID and ids.count(SEP_ID) == 2


def test_save_and_reload(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    again = XLNetTokenizer.from_pretrained(tmp_path)
    assert again.encode("god created light") == tok.encode("god created light")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spiece.model", "tokenizer.json", "tokenizer_config.json"]


def test_cli_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "backend='auto'" in out


def test_python_dash_m_entry_point():
    res = subprocess.run([sys.executable, "-m", "xlnet_fast", "info"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "xlnet_fast" in res.stdout
