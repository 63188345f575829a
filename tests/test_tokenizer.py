"""XLNetTokenizer: trained with XLNet's special ids; its transformers-style conventions (call arguments
and outputs, id/token conversion, decoding, input validation); saved directories that
`tokenizers`/`transformers` open the same way."""

import os
import pickle
import random
import shutil

import numpy as np
import pytest
import torch

from xlnet_fast import XLNetTokenizer, train_tokenizer
from xlnet_fast.pretrain.tokenizer import (CLS_ID, MASK_ID, PAD_ID, SEG_PAD, SEP_ID, SPECIAL_TOKENS, BatchEncoding,
                                  precompiled_charsmap)

WORDS = "in the beginning god created heaven and earth, light was good . day night".split()
# Texts for the comparisons: odd spacing, unknown characters, NFKD/NFKC cases (full-width letters,
# a ligature, zero-width space and BOM, which only sentencepiece's own normalization table handles),
# special tokens written in the text, and the empty string.
TEXTS = ["god created", "  light   was\tgood\n", "alpha \u2603\u2603 beta \ufb01 \uff47\uff4f\uff44",
         "a <mask> b<sep>c", "Caf\u00e9 na\u00efve ``day'' night", "", "god\u200bcreated \ufeffday",
         "GOD Created the HEAVEN", "10 day 9 , night"]
PAIRS = ["heaven", "day was good and night", "", "the <cls> earth", "light", "in the beginning",
         "earth earth", "x", "god"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(3000)]
    return train_tokenizer(lines, 60, tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def digits_tok(tmp_path_factory):
    """Trained on words with digits and a comma ("9, 10")."""
    rng = random.Random(0)
    words = "in the beginning god created heaven and earth light was good 9, 10 day night".split()
    lines = [" ".join(rng.choice(words) for _ in range(10)) for _ in range(3000)]
    return train_tokenizer(lines, 60, tmp_path_factory.mktemp("spm"))


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    """A 40-piece vocabulary over eight words."""
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    lines = [" ".join(words[(i * 7 + j) % 8] for j in range(6)) for i in range(500)]
    return train_tokenizer(lines, 40, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def saved_dir(tok, tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_tok(saved_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(saved_dir)


def god_id(tok):
    return tok.convert_tokens_to_ids("\u2581god")


# ---------------------------------------------------------------------------------------------
# Call: defaults, outputs, arguments
# ---------------------------------------------------------------------------------------------


def test_call_defaults_to_unpadded_python_lists(tok):
    single = tok("god created")
    assert isinstance(single, BatchEncoding)
    assert list(single) == ["input_ids", "token_type_ids", "attention_mask"]
    assert single["input_ids"] == [god_id(tok), tok.convert_tokens_to_ids("\u2581created"), SEP_ID, CLS_ID]
    assert single["token_type_ids"] == [0, 0, 0, 2] and single["attention_mask"] == [1, 1, 1, 1]
    batch = tok(["god", "god created light"])
    assert [len(ids) for ids in batch["input_ids"]] == [3, 5]  # not padded
    assert all(isinstance(i, int) for row in batch["input_ids"] for i in row)


def test_batch_encoding_attribute_access_to_device_and_pickle(tok):
    enc = tok(["god", "god created light"], padding=True, return_tensors="pt")
    assert enc.input_ids is enc["input_ids"] and enc.input_ids.shape == (2, 5)
    assert enc.input_ids.dtype == torch.long
    assert enc.to("cpu") is enc and enc.attention_mask.device.type == "cpu"
    with pytest.raises(AttributeError, match="labels"):
        enc.labels
    again = pickle.loads(pickle.dumps(enc))
    assert isinstance(again, BatchEncoding) and torch.equal(again.input_ids, enc.input_ids)


def test_single_text_with_tensors_has_a_batch_dimension_and_np_works(tok):
    assert tok("god created", return_tensors="pt")["input_ids"].shape == (1, 4)
    enc = tok(["god", "day night"], padding=True, return_tensors="np")
    assert isinstance(enc["input_ids"], np.ndarray) and enc["input_ids"].shape == (2, 4)


def test_optional_columns(tok):
    assert list(tok("god", return_token_type_ids=False)) == ["input_ids", "attention_mask"]
    assert list(tok("god", return_attention_mask=False)) == ["input_ids", "token_type_ids"]


def test_tensors_of_unequal_lengths_ask_for_padding(tok):
    with pytest.raises(ValueError, match="padding=True"):
        tok(["god", "god created light"], return_tensors="pt")


def test_padding_options(tok):
    ids = tok(["god", "god created"], padding="max_length", max_length=6)["input_ids"]
    assert ids[0][:3] == [PAD_ID] * 3 and len(ids[1]) == 6
    assert [len(r) for r in tok(["god", "day"], padding=True, pad_to_multiple_of=8)["input_ids"]] == [8, 8]
    right = tok(["god", "god created"], padding=True, padding_side="right")
    assert right["input_ids"][0][-1] == PAD_ID and right["token_type_ids"][0][-1] == SEG_PAD
    assert right["attention_mask"][0] == [1, 1, 1, 0]
    with pytest.raises(ValueError, match="max_length"):
        tok("god", padding="max_length")
    with pytest.raises(ValueError, match="padding"):
        tok("god", padding="sideways")


def test_batch_of_pair_tuples_equals_text_and_text_pair_lists(tok):
    assert tok([("god", "day"), ("light", "night")]) == tok(["god", "light"], ["day", "night"])


def test_special_tokens_written_in_text_stay_whole(tok):
    pieces = tok.tokenize("a <mask> b<sep>c")
    assert "<mask>" in pieces and "<sep>" in pieces
    assert MASK_ID in tok.encode("the <mask> created", add_special_tokens=False)


# ---------------------------------------------------------------------------------------------
# Trained with XLNet's ids: layout, round trips, edge inputs
# ---------------------------------------------------------------------------------------------


def test_trained_model_has_xlnet_special_ids(digits_tok):
    assert digits_tok.convert_ids_to_tokens(range(9)) == SPECIAL_TOKENS


def test_pair_layout_segments_and_left_padding(digits_tok):
    enc = digits_tok(["god created", "light was good and the earth"], ["heaven", "day"], padding=True,
                     return_tensors="pt")
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


def test_decode_round_trip(digits_tok):
    text = "in the beginning god created heaven and earth"
    assert digits_tok.decode(digits_tok.encode(text), skip_special_tokens=True) == text
    assert digits_tok.decode(digits_tok.encode(text)) == text + "<sep><cls>"


def test_digit_comma_split(digits_tok):
    pieces = digits_tok.tokenize("day 9, night")
    assert "," in pieces and not any(p.endswith(",") and len(p) > 1 and p[-2].isdigit() for p in pieces)


def test_truncation_keeps_special_tokens(digits_tok):
    ids = digits_tok.encode("god " * 50, "earth " * 50, max_length=16, truncation=True)
    assert len(ids) == 16 and ids[-1] == CLS_ID and ids.count(SEP_ID) == 2


def test_save_and_reload(digits_tok, tmp_path):
    digits_tok.save_pretrained(tmp_path)
    again = XLNetTokenizer.from_pretrained(tmp_path)
    assert again.encode("god created light") == digits_tok.encode("god created light")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spiece.model", "tokenizer.json", "tokenizer_config.json"]


def test_tokenizer_empty_string(tiny_tok):
    enc = tiny_tok("", return_tensors="pt")
    assert enc["input_ids"].tolist() == [[SEP_ID, CLS_ID]]
    assert tiny_tok.decode([]) == ""


def test_tokenizer_unknown_characters_map_to_unk(tiny_tok):
    ids = tiny_tok.encode("alpha \u2603\u2603 beta", add_special_tokens=False)
    assert 0 in ids  # <unk>
    assert "alpha" in tiny_tok.decode(ids) and "beta" in tiny_tok.decode(ids)


def test_tokenizer_over_long_input(tiny_tok):
    long = "alpha beta " * 500
    enc = tiny_tok([long, "gamma"], truncation=True, max_length=32, padding=True, return_tensors="pt")
    assert enc["input_ids"].shape == (2, 32)
    assert enc["input_ids"][0, -1] == CLS_ID and enc["attention_mask"][1].sum() < 32
    with pytest.raises(ValueError, match="max_length"):
        tiny_tok("alpha", max_length=1, truncation=True, text_pair="beta")
    with pytest.raises(TypeError, match="text"):
        tiny_tok.encode(None)


# ---------------------------------------------------------------------------------------------
# Truncation
# ---------------------------------------------------------------------------------------------


def test_max_length_alone_truncates_longest_first(tok):
    ids = tok("god " * 20, max_length=5)["input_ids"]
    assert ids == [god_id(tok)] * 3 + [SEP_ID, CLS_ID]
    # with padding, max_length alone does not truncate (as in transformers)
    assert len(tok(["god " * 20, "day"], padding="max_length", max_length=5)["input_ids"][0]) == 22


@pytest.mark.parametrize("n_first,n_second,max_length,kept", [
    (50, 50, 16, (6, 7)), (50, 50, 17, (7, 7)), (10, 9, 16, (7, 6)), (3, 50, 16, (3, 10)), (50, 3, 16, (10, 3)),
])
def test_longest_first_split_matches_tokenizers(tok, n_first, n_second, max_length, kept):
    ids = tok.encode("god " * n_first, "day " * n_second, max_length=max_length, truncation=True)
    first, second = ids[: ids.index(SEP_ID)], ids[ids.index(SEP_ID) + 1: -2]
    assert (len(first), len(second)) == kept and len(ids) == max_length


def test_only_first_and_only_second(tok):
    ids = tok.encode("god god god", "day day", max_length=6, truncation="only_first")
    assert ids.count(god_id(tok)) == 1 and len(ids) == 6
    ids = tok.encode("god god", "day day day", max_length=6, truncation="only_second")
    assert ids.count(god_id(tok)) == 2 and len(ids) == 6
    with pytest.raises(ValueError, match="text_pair"):
        tok.encode("god god god", "day day day", max_length=6, truncation="only_second")
    with pytest.raises(ValueError, match="needs a text_pair"):
        tok.encode("god god god", max_length=3, truncation="only_second")
    with pytest.raises(ValueError, match="truncation"):
        tok("god", truncation="middle", max_length=4)


# ---------------------------------------------------------------------------------------------
# Ids <-> tokens, decoding
# ---------------------------------------------------------------------------------------------


def test_convert_ids_to_tokens_takes_call_output_ints_and_tensors(tok):
    ids = tok("god created")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["\u2581god", "\u2581created", "<sep>", "<cls>"]
    assert tok.convert_ids_to_tokens(CLS_ID) == "<cls>"
    assert tok.convert_ids_to_tokens(torch.tensor(ids)) == tok.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(ids, skip_special_tokens=True) == ["\u2581god", "\u2581created"]


def test_convert_tokens_to_ids_takes_a_str_or_a_list(tok):
    assert tok.convert_tokens_to_ids("<cls>") == CLS_ID
    assert tok.convert_tokens_to_ids(["<sep>", "<cls>", "no-such-piece"]) == [SEP_ID, CLS_ID, 0]
    with pytest.raises(TypeError, match=r"tokens\[1\]"):
        tok.convert_tokens_to_ids(["<sep>", 3])


def test_decode_shows_special_tokens_unless_skipped(tok):
    ids = tok("god created")["input_ids"]
    assert tok.decode(ids) == "god created<sep><cls>"
    assert tok.decode(ids, skip_special_tokens=True) == "god created"
    assert tok.decode([MASK_ID, god_id(tok)]) == "<mask> god"
    assert tok.decode([0, god_id(tok)]) == "<unk> god"
    assert tok.decode(god_id(tok)) == "god"
    assert tok.batch_decode(torch.tensor([ids, ids]), skip_special_tokens=True) == ["god created"] * 2


def test_decode_clean_up_tokenization_spaces(tok):
    ids = tok.encode("god , created", add_special_tokens=False)
    assert tok.decode(ids) == "god , created"
    assert tok.decode(ids, clean_up_tokenization_spaces=True) == "god, created"


@pytest.mark.parametrize("call", [
    lambda t: t.decode([-1]),
    lambda t: t.decode([5, t.vocab_size]),
    lambda t: t.convert_ids_to_tokens([5, -1]),
    lambda t: t.convert_ids_to_tokens(t.vocab_size),
    lambda t: t.batch_decode([[5], [-1]]),
])
def test_out_of_range_ids_raise_value_error_naming_them(tok, call):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, \d+\): \[(-1|\d+)\]"):
        call(tok)


def test_non_int_ids_raise_type_error(tok):
    with pytest.raises(TypeError, match="ints"):
        tok.decode([1.5])
    with pytest.raises(TypeError, match="batch_decode"):
        tok.decode(torch.zeros(2, 3, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    ((None,), r"text must be a str.*got None"),
    ((5,), r"text must be a str.*got int"),
    ((["god", 5],), r"text\[1\] must be a str, got int"),
    (("god", 5), r"text_pair must be a str.*got int"),
    ((["god"], "day"), r"text_pair must be a list"),
    ((["god"], ["day", None]), r"text_pair has 2 entries"),
    (([("god", 5)],), r"text\[0\] must be a \(text, text_pair\) pair"),
])
def test_wrong_inputs_name_the_argument(tok, args, message):
    with pytest.raises((TypeError, ValueError), match=message):
        tok(*args)


def test_encode_and_tokenize_reject_non_str(tok):
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(["god", "day"])
    with pytest.raises(TypeError, match="text must be a str, got None"):
        tok.tokenize(None)


# ---------------------------------------------------------------------------------------------
# Saving: options round trip, tokenizer.json, transformers
# ---------------------------------------------------------------------------------------------


def test_saved_options_are_restored(tok, tmp_path):
    lower = XLNetTokenizer(tok.model_file, do_lower_case=True)
    lower.padding_side = "right"
    lower.save_pretrained(tmp_path)
    again = XLNetTokenizer.from_pretrained(tmp_path)
    assert again.do_lower_case and again.padding_side == "right"
    assert again.encode("GOD") == lower.encode("GOD") == tok.encode("god")
    assert not XLNetTokenizer.from_pretrained(tmp_path, do_lower_case=False).do_lower_case


def test_train_tokenizer_writes_the_files_transformers_reads(tok):
    written = sorted(os.listdir(os.path.dirname(tok.model_file)))
    assert written == ["spiece.model", "tokenizer.json", "tokenizer_config.json"]


def test_precompiled_charsmap_is_read_from_the_model(tok):
    charsmap = precompiled_charsmap(tok.sp.serialized_model_proto())
    assert len(charsmap) > 1000  # nmt_nfkc's table
    tokenizers = pytest.importorskip("tokenizers")
    normalizer = tokenizers.normalizers.Precompiled(charsmap)
    assert normalizer.normalize_str("god\u200bcreated") == "god created"  # NFKD keeps \u200b


def test_tokenizer_json_matches_the_tokenizers_library(tok, saved_dir):
    tokenizers = pytest.importorskip("tokenizers")
    backend = tokenizers.Tokenizer.from_file(os.path.join(saved_dir, "tokenizer.json"))
    for text, pair in zip(TEXTS, PAIRS):
        for args in ((text,), (text, pair)):
            ours = tok(*args)
            theirs = backend.encode(*args)
            assert (ours["input_ids"], ours["token_type_ids"]) == (theirs.ids, theirs.type_ids), args
            ids = ours["input_ids"]
            assert tok.decode(ids, skip_special_tokens=True) == backend.decode(ids, skip_special_tokens=True)


def test_transformers_autotokenizer_opens_the_saved_directory(hf_tok):
    assert type(hf_tok).__name__ in ("XLNetTokenizer", "XLNetTokenizerFast")  # transformers 5 / 4
    assert hf_tok.padding_side == "left"
    assert hf_tok.model_input_names == ["input_ids", "token_type_ids", "attention_mask"]


def test_transformers_needs_no_sentencepiece_conversion(saved_dir, tmp_path):
    """Without spiece.model, transformers must build the tokenizer from tokenizer.json alone (the
    conversion from spiece.model is what needs protobuf)."""
    transformers = pytest.importorskip("transformers")
    shutil.copytree(saved_dir, tmp_path / "copy")
    os.remove(tmp_path / "copy" / "spiece.model")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "copy")
    assert hf("god created")["input_ids"] == hf.convert_tokens_to_ids(["\u2581god", "\u2581created", "<sep>", "<cls>"])


@pytest.mark.parametrize("with_pair", [False, True])
def test_same_encodings_and_decodings_as_transformers(tok, hf_tok, with_pair):
    for text, pair in zip(TEXTS, PAIRS):
        if with_pair and not pair:
            continue  # transformers takes text_pair="" as no pair in a single call (not in a batch)
        args = (text, pair) if with_pair else (text,)
        ours, theirs = tok(*args), hf_tok(*args)
        assert dict(ours) == dict(theirs), args
        ids = ours["input_ids"]
        assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_same_padded_batches_as_transformers(tok, hf_tok):
    for kwargs in ({"padding": True}, {"padding": "max_length", "max_length": 24, "truncation": True},
                   {"padding": True, "pad_to_multiple_of": 8}, {"padding": True, "padding_side": "right"}):
        ours = tok(TEXTS, PAIRS, return_tensors="pt", **kwargs)
        theirs = hf_tok(TEXTS, PAIRS, return_tensors="pt", **kwargs)
        assert torch.equal(ours["input_ids"], theirs["input_ids"]), kwargs
        assert torch.equal(ours["attention_mask"], theirs["attention_mask"]), kwargs
        real = ours["attention_mask"].bool()
        # transformers 5 pads token types with 0 (its XLNetTokenizer's 3 is reset by the base
        # class); 4.x and this tokenizer use 3. Real tokens must agree.
        assert torch.equal(ours["token_type_ids"][real], theirs["token_type_ids"][real]), kwargs
        assert ours["token_type_ids"][~real].eq(SEG_PAD).all()


@pytest.mark.parametrize("pair,kwargs", [
    ("light was good", {"max_length": 8, "truncation": True}),
    ("light was good", {"max_length": 9, "truncation": "only_first"}),
    ("light was good and the earth in the beginning", {"max_length": 14, "truncation": "only_second"}),
    ("light was good", {"max_length": 6}),
])
def test_same_truncation_as_transformers(tok, hf_tok, pair, kwargs):
    text = "god created the heaven and the earth"
    ours = tok(text, pair, **kwargs)["input_ids"]
    assert len(ours) == kwargs["max_length"] and ours == hf_tok(text, pair, **kwargs)["input_ids"]
