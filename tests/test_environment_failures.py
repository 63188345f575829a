"""A full disk (files limited through RLIMIT_FSIZE in a child process) or a path under a file is one
line naming the path and exit status 1, never a traceback, and leaves no partial output a later
command could take as complete: a failed checkpoint leaves no ``step_N.tmp`` and the previous
checkpoint resumes; a failed prepare leaves an index that says it did not finish; a failed export or
tokenizer leaves nothing."""

import os

import pytest

from helpers.faults import error_line, run, xlnet_fast
from helpers.pretraining import pretrain_command, train_config, write_corpus

from xlnet_fast.pretrain import pretrain
from xlnet_fast.pretrain.errors import UsageError
from xlnet_fast.pretrain.prepare import TokenShards, prepare_corpus
from xlnet_fast.pretrain.tokenizer import XLNetTokenizer

FULL = 1_000_000  # bytes a file may reach: more than the tokenizer's files, less than the weights


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus, cache):
    out = tmp_path_factory.mktemp("runs") / "run"
    pretrain(train_config(out, corpus, cache, steps=1))
    return out


def test_a_checkpoint_save_on_a_full_disk(run_dir, corpus, cache):
    res = run(pretrain_command(run_dir, corpus, cache, "--resume", "--steps", "2"), max_file_bytes=FULL)
    assert res.returncode == 1
    line = error_line(res.stderr)
    assert f"{run_dir / 'checkpoints' / 'step_0000002.tmp'}" in line and "File too large" in line
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_0000001"]  # no step_N.tmp left
    res = run(pretrain_command(run_dir, corpus, cache, "--resume", "--steps", "2"))
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_0000001", "step_0000002"]


def test_prepare_export_and_tokenizer_on_a_full_disk(run_dir, corpus, tmp_path):
    res = xlnet_fast("tokenizer", "train", corpus, "--vocab-size", "120", "--out", tmp_path / "tok",
                     max_file_bytes=10_000)
    assert res.returncode == 1 and str(tmp_path) in error_line(res.stderr)
    assert os.listdir(tmp_path / "tok") == [] and sorted(os.listdir(tmp_path)) == ["tok"]
    tok = XLNetTokenizer.from_pretrained(run_dir / "checkpoints" / "step_0000001")
    prepare_corpus([corpus], tok, tmp_path / "data", workers=1)  # the tokenizer is in place: shards fail below
    other = write_corpus(tmp_path / "other.txt", seed=1)
    res = xlnet_fast("data", "prepare", other, "--tokenizer", run_dir / "checkpoints" / "step_0000001", "--out",
                     tmp_path / "data", "--shard-tokens", "4000", "--no-progress", "--overwrite", max_file_bytes=3_000)
    assert res.returncode == 1 and str(tmp_path / "data" / "shard-00000") in error_line(res.stderr)
    assert not [n for n in os.listdir(tmp_path / "data") if ".tmp" in n]
    with pytest.raises(UsageError, match="did not finish"):
        TokenShards(tmp_path / "data")
    res = xlnet_fast("export", run_dir, "--out", tmp_path / "export", max_file_bytes=FULL)
    assert res.returncode == 1
    assert f"{tmp_path / 'export'}" in error_line(res.stderr) and "File too large" in error_line(res.stderr)
    assert sorted(os.listdir(tmp_path)) == ["data", "other.txt", "tok"]  # no export, no temporary beside it
