"""Transformer-XL's word-level vocabulary: a 4.x ``vocab.pkl`` is read without constructing any object
it names (no import, no call), the vocabulary fields must be plain, and the tokenizer saves the safe
``vocab.txt`` format; text <-> ids as the original code splits it."""

import collections
import importlib.util
import json
import os
import pickle
import re

import pytest

from xlnet_fast.transfo_xl.tokenizer import OpaqueObject, TransfoXLTokenizer, read_vocab_pickle

SYMBOLS = ["<eos>", "<unk>", "the", "cat", "sat", "on", "mat", "@,@", "1", "000", "."]


class _Runs:
    """Pickles as a call of ``os.system``: it would create ``marker`` if it were ever called."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Pattern:
    """Pickles like 4.x's compiled patterns (``re._compile``)."""

    def __reduce__(self):
        return re.compile, ("[a-z]+",)


def write_4x_pickle(path, marker, **overrides):
    """A ``vocab.pkl`` shaped like transformers 4.x's (its tokenizer's ``__dict__``), with objects."""
    state = {"idx2sym": list(SYMBOLS), "sym2idx": collections.OrderedDict((s, i) for i, s in enumerate(SYMBOLS)),
             "counter": collections.Counter(SYMBOLS), "special": ["<eos>"], "lower_case": True, "delimiter": None,
             "unk_idx": 1, "punctuation_with_space_around_pattern": _Pattern(), "moses_tokenizer": _Runs(marker)}
    state.update(overrides)
    with open(path, "wb") as f:
        pickle.dump(state, f)


def test_4x_pickle_is_read_without_running_anything(tmp_path):
    marker = tmp_path / "ran"
    write_4x_pickle(tmp_path / "vocab.pkl", marker)
    state = read_vocab_pickle(str(tmp_path / "vocab.pkl"))
    assert not marker.exists()
    assert isinstance(state["moses_tokenizer"], OpaqueObject) and state["moses_tokenizer"].qualname.endswith("system")
    assert isinstance(state["punctuation_with_space_around_pattern"], OpaqueObject)
    assert state["counter"] == collections.Counter(SYMBOLS) and isinstance(state["sym2idx"], collections.OrderedDict)
    tok = TransfoXLTokenizer.from_pretrained(tmp_path)
    assert not marker.exists()
    assert tok.idx2sym == SYMBOLS and tok.lower_case  # the pickle's setting
    assert tok.encode("The cat sat", add_eos=True) == [2, 3, 4, 0]


@pytest.mark.parametrize("idx2sym, message", [
    (None, "got nothing"),
    ("the cat", "got a str"),
    (["the", 3], "got a list holding other values"),
])
def test_vocabulary_fields_must_be_plain(tmp_path, idx2sym, message):
    write_4x_pickle(tmp_path / "vocab.pkl", tmp_path / "ran", idx2sym=idx2sym)
    with pytest.raises(ValueError, match=f"'idx2sym' must be a list of strings, {message}"):
        TransfoXLTokenizer.from_pretrained(tmp_path)


def test_an_object_as_the_vocabulary_is_refused(tmp_path):
    marker = tmp_path / "ran"
    write_4x_pickle(tmp_path / "vocab.pkl", marker, idx2sym=_Runs(marker))
    with pytest.raises(ValueError, match=r"got an object of (posix|os)\.system \(not loaded\)"):
        TransfoXLTokenizer.from_pretrained(tmp_path)
    assert not marker.exists()


def test_foreign_files_are_clear_errors(tmp_path):
    (tmp_path / "vocab.pkl").write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match="not a readable vocabulary pickle"):
        TransfoXLTokenizer.from_pretrained(tmp_path)
    (tmp_path / "vocab.pkl").write_bytes(pickle.dumps(["a", "b"]))
    with pytest.raises(ValueError, match="expected a pickled dict"):
        TransfoXLTokenizer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no vocab.txt or vocab.pkl"):
        TransfoXLTokenizer.from_pretrained(tmp_path / "missing")


def test_save_writes_the_safe_format_and_reads_it_back(tmp_path):
    write_4x_pickle(tmp_path / "vocab.pkl", tmp_path / "ran")
    tok = TransfoXLTokenizer.from_pretrained(tmp_path)
    tok.save_pretrained(tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["tokenizer_config.json", "vocab.txt"]
    assert (tmp_path / "out" / "vocab.txt").read_text().split("\n")[:3] == ["<eos>", "<unk>", "the"]
    config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TransfoXLTokenizer" and config["lower_case"] is True
    again = TransfoXLTokenizer.from_pretrained(tmp_path / "out")
    assert again.idx2sym == SYMBOLS and again.lower_case
    with pytest.raises(ValueError, match="symbols with whitespace"):
        TransfoXLTokenizer(["a b", "c"]).save_pretrained(tmp_path / "bad")


def test_text_to_ids_and_back():
    tok = TransfoXLTokenizer(SYMBOLS, moses=False)
    assert tok.tokenize("the cat sat on the mat .", add_eos=True)[-2:] == [".", "<eos>"]
    assert tok.encode("the dog sat") == [2, 1, 4]  # unknown -> <unk>
    assert tok.decode([2, 3, 8, 7, 9]) == "the cat 1,000"  # 4.x's number joining
    assert tok(" the cat ")["input_ids"] == [2, 3]
    assert tok("the cat", return_tensors="pt")["input_ids"].tolist() == [[2, 3]]
    with pytest.raises(ValueError, match=r"ids out of the vocabulary \[0, 11\): \[11\]"):
        tok.decode([11])
    with pytest.raises(ValueError, match="not in the vocabulary, which has no <unk>"):
        TransfoXLTokenizer(["a", "b"], moses=False).encode("c")
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(3)
    assert TransfoXLTokenizer(list("abc"), delimiter="").encode("cab") == [2, 0, 1]


def test_moses_needs_sacremoses():
    if importlib.util.find_spec("sacremoses") is None:
        with pytest.raises(ImportError, match="pip install sacremoses"):
            TransfoXLTokenizer(SYMBOLS, moses=True)
    else:
        tok = TransfoXLTokenizer(SYMBOLS + ["1,000"], moses=True)
        assert tok.tokenize("the cat sat on 1,000 mats.") == ["the", "cat", "sat", "on", "1", "@,@", "000", "mats", "."]
