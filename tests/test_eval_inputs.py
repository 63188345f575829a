"""`xlnet-fast eval` on what runs are trained and evaluated on: a run trained on a prepared directory
(its held-out tail), ``--data`` naming a prepared directory, a run whose ``--eval-data`` changed since
(refused, not evaluated silently on the new text), and ``--batches 0`` (refused, not taken as 10)."""

import json

import pytest

from helpers.pretraining import TINY_RUN, train_config, write_corpus

from xlnet_fast.cli import main
from xlnet_fast.pretrain import pretrain
from xlnet_fast.pretrain.corpus import iter_lines
from xlnet_fast.pretrain.prepare import prepare_corpus
from xlnet_fast.pretrain.tokenizer import train_tokenizer


def eval_rows(out):
    return [r for r in map(json.loads, open(out / "metrics.jsonl")) if "eval_loss" in r]


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("xlnet-fast")]
    assert len(err) == 1 and ": error: " in err[0], err
    return err[0]


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    tok = train_tokenizer(iter_lines([corpus]), TINY_RUN["vocab_size"], tmp_path_factory.mktemp("tok"))
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare_corpus([corpus], tok, out, workers=1)
    return out


def test_eval_of_a_run_trained_on_a_prepared_directory(prepared, cache, tmp_path, capsys):
    out = tmp_path / "run"
    pretrain(train_config(out, str(prepared), cache, steps=1, eval_batches=2, vocab_size=None))  # the data's
    capsys.readouterr()
    assert main(["eval", "--model", str(out), "--cache-dir", cache]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["eval_loss"] == pytest.approx(eval_rows(out)[-1]["eval_loss"], rel=1e-9)
    assert main(["eval", "--model", str(out), "--data", str(prepared), "--cache-dir", cache, "--batches", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["data"] == str(prepared)
    assert main(["eval", "--model", str(out), "--batches", "0", "--cache-dir", cache]) == 2
    assert "--batches must be a positive integer, got 0" in one_error_line(capsys)


def test_eval_refuses_a_run_whose_eval_data_changed(corpus, cache, tmp_path, capsys):
    held = write_corpus(tmp_path / "held.txt", seed=3, docs=6)
    out = tmp_path / "run"
    pretrain(train_config(out, corpus, cache, steps=1, eval_data=[held], eval_batches=1))
    capsys.readouterr()
    assert main(["eval", "--model", str(out), "--cache-dir", cache]) == 0
    write_corpus(held, seed=4, docs=6)  # other text under the same name
    assert main(["eval", "--model", str(out), "--cache-dir", cache]) == 2
    assert f"the run's --eval-data {held} changed since the run" in one_error_line(capsys)
