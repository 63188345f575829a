"""Data is checked where it is read. Prepared data on every open: the index, the tokenizer, each shard
file's size always; the sha256 of shards changed since they were written (or of all with
``verify=True``/``--verify-data``); every id against the vocabulary as it is read — each problem one
error naming the file, and preparing again repairs it. JSON lines are recognised whatever the case of
the suffix (``.jsonl``, ``.JSONL``, ``.ndjson``); ``--vocab-size`` is never silently ignored."""

import json
import os
import shutil

import numpy as np
import pytest

from helpers.pretraining import TINY_RUN, train_config

from xlnet_fast.cli import main
from xlnet_fast.pretrain import pretrain
from xlnet_fast.pretrain.corpus import file_digest, iter_documents, iter_lines
from xlnet_fast.pretrain.errors import UsageError
from xlnet_fast.pretrain.prepare import TokenShards, prepare_corpus
from xlnet_fast.pretrain.tokenizer import train_tokenizer

SHARD_TOKENS = 4000


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory):
    return train_tokenizer(iter_lines([corpus]), TINY_RUN["vocab_size"], tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def prepared(corpus, tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare_corpus([corpus], tok, out, workers=1, shard_tokens=SHARD_TOKENS)
    assert len(TokenShards(out).index["shards"]) >= 3
    return out


@pytest.fixture
def data(prepared, tmp_path):
    """A copy of the prepared directory (file times kept, as ``cp -p`` keeps them)."""
    copy = tmp_path / "data"
    shutil.copytree(prepared, copy)
    for name in os.listdir(prepared):
        st = os.stat(prepared / name)
        os.utime(copy / name, ns=(st.st_atime_ns, st.st_mtime_ns))
    return copy


def rewrite_keeping_time(path, ids: np.ndarray, st: os.stat_result | None = None) -> None:
    """Replace a shard's ids with ``ids`` (same size) and put its modification time back (``st``'s)."""
    st = st or os.stat(path)
    ids.astype("<u2").tofile(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def edit_index(directory, change) -> None:
    index = json.loads((directory / "index.json").read_text())
    change(index)
    (directory / "index.json").write_text(json.dumps(index))


def test_cheap_checks_name_the_file_and_the_field(data):
    shutil.rmtree(data / "tokenizer")
    with pytest.raises(UsageError, match=f"{data / 'tokenizer' / 'spiece.model'} is missing"):
        TokenShards(data)


@pytest.mark.parametrize("damage,message", [
    (lambda d: edit_index(d, lambda i: i.pop("num_tokens")), "index.json: 'num_tokens' is missing"),
    (lambda d: edit_index(d, lambda i: i["shards"][1].pop("sha256")), "index.json: shard 1: 'sha256' is missing"),
    (lambda d: edit_index(d, lambda i: i.update(dtype="float64")), "'dtype' 'float64' is neither"),
    (lambda d: os.remove(d / "shard-00001.docs.bin"), "shard-00001.docs.bin is missing or truncated"),
])
def test_a_damaged_index_or_a_missing_file_is_named(data, damage, message):
    damage(data)
    with pytest.raises(UsageError, match=message):
        TokenShards(data)


def test_a_same_size_edit_is_found_and_prepared_again(data, corpus, tok, caplog):
    original = np.array(TokenShards(data)[:])
    shard = data / "shard-00001.bin"
    as_prepared = os.stat(shard)
    ids = np.fromfile(shard, dtype="<u2")
    ids[::2] = 10  # valid ids, other tokens
    ids.tofile(shard)  # a new modification time: hashed on open
    with pytest.raises(UsageError, match="shard-00001.bin does not match its sha256 in index.json"):
        TokenShards(data)
    rewrite_keeping_time(shard, ids, as_prepared)  # the time put back: only a full verification finds it
    TokenShards(data)
    with pytest.raises(UsageError, match="shard-00001.bin does not match its sha256"):
        TokenShards(data, verify=True)
    assert main(["pretrain", "--data", str(data), "--verify-data", "--out", str(data.parent / "run"),
                 "--no-progress"]) == 2
    assert main(["data", "prepare", corpus, "--tokenizer", os.path.dirname(tok.model_file), "--out", str(data),
                 "--shard-tokens", str(SHARD_TOKENS), "--workers", "1", "--no-progress"]) == 0  # hashes every shard
    assert "shard-00001.bin does not match its sha256" in caplog.text
    assert np.array_equal(TokenShards(data, verify=True)[:], original)


def test_ids_past_the_vocabulary_name_the_shard(data, tok, cache, capsys):
    shard = data / "shard-00000.bin"
    rewrite_keeping_time(shard, np.full(os.path.getsize(shard) // 2, 5000))
    message = f"{shard}: token id 5000 at position 0 is outside the vocabulary of {tok.vocab_size}"
    with pytest.raises(UsageError, match=message):
        TokenShards(data)[:10]
    args = ["pretrain", "--data", str(data), "--out", str(data.parent / "run"), "--cache-dir", cache, "--steps", "1",
            "--no-progress", "--backend", "eager", *[a for k, v in TINY_RUN.items() if k != "vocab_size"
                                                     for a in (f"--{k.replace('_', '-')}", str(v))]]
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("xlnet-fast")]
    assert len(err) == 1 and "shard-00000.bin: token id 5000" in err[0]


def test_vocab_size_with_a_given_tokenizer_is_not_ignored(prepared, tok, corpus, cache, tmp_path):
    with pytest.raises(UsageError, match=f"--vocab-size 300: the tokenizer of the prepared --data {prepared} has "
                                         f"{tok.vocab_size} pieces"):
        pretrain(train_config(tmp_path / "run", str(prepared), cache, vocab_size=300))
    with pytest.raises(UsageError, match="--vocab-size 300: the tokenizer of --tokenizer"):
        pretrain(train_config(tmp_path / "run", corpus, cache, vocab_size=300,
                              tokenizer=os.path.dirname(tok.model_file)))


@pytest.mark.parametrize("suffix", [".JSONL", ".ndjson", ".NDJSON"])
def test_json_lines_whatever_the_suffix(tmp_path, suffix):
    rows = [{"book": b, "text": f"line {i} of book {b}"} for b in (1, 2) for i in range(3)]
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    (tmp_path / "a.jsonl").write_text(text)
    (tmp_path / f"b{suffix}").write_text(text)
    expected = [[f"line {i} of book {b}" for i in range(3)] for b in (1, 2)]
    assert list(iter_documents([tmp_path / f"b{suffix}"])) == expected
    assert file_digest(str(tmp_path / f"b{suffix}")) == file_digest(str(tmp_path / "a.jsonl"))
