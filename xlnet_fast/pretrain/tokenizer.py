"""XLNet tokenizer over sentencepiece, with XLNet's conventions and transformers' calling conventions.

Ids ``<unk>0 <s>1 </s>2 <cls>3 <sep>4 <pad>5 <mask>6 <eod>7 <eop>8``; a pair is laid out
``A <sep> B <sep> <cls>`` with segment ids 0 (A and its <sep>), 1 (B and its <sep>), 2 (<cls>);
batches are padded on the left (padding gets token type 3, as in ``transformers``).
``tok(text)`` takes the same common arguments as ``transformers``' tokenizers and returns python
lists unless ``return_tensors`` is given; ``save_pretrained`` also writes ``tokenizer.json`` and
``tokenizer_config.json`` so that ``transformers.AutoTokenizer`` opens the directory without protobuf.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import operator
import os
import re
import shutil
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np
import torch

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<cls>", "<sep>", "<pad>", "<mask>", "<eod>", "<eop>"]
UNK_ID, BOS_ID, EOS_ID, CLS_ID, SEP_ID, PAD_ID, MASK_ID, EOD_ID, EOP_ID = range(9)
SEG_A, SEG_B, SEG_CLS, SEG_PAD = 0, 1, 2, 3
SPIECE_NAME = "spiece.model"
TOKENIZER_JSON_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
TOKENIZER_FILES = (SPIECE_NAME, TOKENIZER_JSON_NAME, TOKENIZER_CONFIG_NAME)  # what save_pretrained writes
MODEL_INPUT_NAMES = ["input_ids", "token_type_ids", "attention_mask"]
_UNDERLINE = "\u2581"
_SPECIAL_TOKEN_SPLIT = re.compile(
    "(" + "|".join(re.escape(t) for t in sorted(SPECIAL_TOKENS, key=len, reverse=True)) + ")")
_PADDING_MODES = {True: "longest", "longest": "longest", "max_length": "max_length",
                  False: None, None: None, "do_not_pad": None}
_TRUNCATION_MODES = {True: "longest_first", "longest_first": "longest_first", "only_first": "only_first",
                     "only_second": "only_second", False: None, "do_not_truncate": None}

logger = logging.getLogger(__name__)


def _kind(value) -> str:
    return "None" if value is None else type(value).__name__


class BatchEncoding(dict):
    """The tokenizer's output: a dict that also allows ``enc.input_ids`` and ``enc.to(device)``."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no {name!r} in this encoding (keys: {list(self)})") from None

    def to(self, device: str | torch.device, non_blocking: bool = False) -> "BatchEncoding":
        """Move the tensors to ``device`` in place; returns self."""
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.to(device, non_blocking=non_blocking)
        return self


class XLNetTokenizer:
    """Sentencepiece tokenizer with XLNet's special ids, layout and left padding."""

    padding_side = "left"
    model_input_names = MODEL_INPUT_NAMES
    unk_token, bos_token, eos_token, cls_token, sep_token, pad_token, mask_token = (
        "<unk>", "<s>", "</s>", "<cls>", "<sep>", "<pad>", "<mask>")
    pad_token_id, cls_token_id, sep_token_id, mask_token_id = PAD_ID, CLS_ID, SEP_ID, MASK_ID
    unk_token_id, bos_token_id, eos_token_id = UNK_ID, BOS_ID, EOS_ID
    pad_token_type_id = SEG_PAD

    def __init__(self, model_file: str | os.PathLike, do_lower_case: bool = False,
                 remove_space: bool = True, keep_accents: bool = False) -> None:
        import sentencepiece as spm

        self.model_file = os.fspath(model_file)
        if not os.path.isfile(self.model_file):
            raise FileNotFoundError(f"sentencepiece model not found: {self.model_file}")
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(self.model_file)
        except Exception as exc:
            raise ValueError(f"{self.model_file} is not a valid sentencepiece model: {exc}") from None
        for i, tok in enumerate(SPECIAL_TOKENS):
            if self.sp.GetPieceSize() <= i or self.sp.IdToPiece(i) != tok:
                raise ValueError(f"{self.model_file}: id {i} must be {tok!r} (XLNet's special ids)")
        self.do_lower_case = do_lower_case
        self.remove_space = remove_space
        self.keep_accents = keep_accents

    # ---------------------------------------------------------------- loading / saving
    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **kwargs) -> "XLNetTokenizer":
        """Load ``spiece.model`` from a directory (or a path to the model file itself).

        Options saved in the directory's ``tokenizer_config.json`` (``do_lower_case``,
        ``remove_space``, ``keep_accents``, ``padding_side``) apply unless given in ``kwargs``.
        """
        path = os.fspath(directory)
        saved: dict = {}
        if os.path.isdir(path):
            config_path = os.path.join(path, TOKENIZER_CONFIG_NAME)
            if os.path.isfile(config_path):
                with open(config_path, encoding="utf-8") as f:
                    saved = json.load(f)
            path = os.path.join(path, SPIECE_NAME)
        options = {k: saved[k] for k in ("do_lower_case", "remove_space", "keep_accents") if k in saved}
        options.update(kwargs)
        padding_side = options.pop("padding_side", saved.get("padding_side"))
        tokenizer = cls(path, **options)
        if padding_side is not None:
            tokenizer.padding_side = _check_padding_side(padding_side)
        return tokenizer

    def save_pretrained(self, directory: str | os.PathLike) -> tuple[str, ...]:
        """Write ``spiece.model``, ``tokenizer.json`` and ``tokenizer_config.json``; returns their paths.

        ``tokenizer.json`` is the ``tokenizers`` library's format, so ``transformers`` opens the
        directory without converting the sentencepiece model (which would need protobuf).
        """
        os.makedirs(directory, exist_ok=True)
        model_path = os.path.join(directory, SPIECE_NAME)
        if os.path.abspath(model_path) != os.path.abspath(self.model_file):
            shutil.copyfile(self.model_file, model_path)
        json_path = os.path.join(directory, TOKENIZER_JSON_NAME)
        config_path = os.path.join(directory, TOKENIZER_CONFIG_NAME)
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(self._tokenizers_json(), f, ensure_ascii=False)
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(self._transformers_config(), f, ensure_ascii=False, indent=2)
        return model_path, json_path, config_path

    def _transformers_config(self) -> dict:
        """``tokenizer_config.json`` for ``transformers.AutoTokenizer``."""
        return {
            "tokenizer_class": "XLNetTokenizer",
            "do_lower_case": self.do_lower_case, "remove_space": self.remove_space,
            "keep_accents": self.keep_accents,
            "unk_token": self.unk_token, "bos_token": self.bos_token, "eos_token": self.eos_token,
            "cls_token": self.cls_token, "sep_token": self.sep_token, "pad_token": self.pad_token,
            "mask_token": self.mask_token, "additional_special_tokens": ["<eop>", "<eod>"],
            "padding_side": self.padding_side, "model_input_names": list(self.model_input_names),
            "clean_up_tokenization_spaces": False,
        }

    def _tokenizers_json(self) -> dict:
        """This tokenizer in the ``tokenizers`` library's serialization format (``tokenizer.json``)."""
        normalizers: list[dict] = [{"type": "Replace", "pattern": {"String": "``"}, "content": '"'},
                                   {"type": "Replace", "pattern": {"String": "''"}, "content": '"'}]
        if not self.keep_accents:
            normalizers += [{"type": "NFKD"}, {"type": "StripAccents"}]
        if self.do_lower_case:
            normalizers.append({"type": "Lowercase"})
        charsmap = precompiled_charsmap(self.sp.serialized_model_proto())
        if charsmap:
            normalizers.append({"type": "Precompiled",
                                "precompiled_charsmap": base64.b64encode(charsmap).decode("ascii")})
        metaspace = {"type": "Metaspace", "replacement": _UNDERLINE, "prepend_scheme": "always", "split": True}

        def seq(type_id: int, name: str) -> dict:
            return {"Sequence": {"id": name, "type_id": type_id}}

        def special(type_id: int, token: str) -> dict:
            return {"SpecialToken": {"id": token, "type_id": type_id}}

        return {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)],
            "normalizer": {"type": "Sequence", "normalizers": normalizers},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"}, metaspace]},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [seq(SEG_A, "A"), special(SEG_A, "<sep>"), special(SEG_CLS, "<cls>")],
                "pair": [seq(SEG_A, "A"), special(SEG_A, "<sep>"), seq(SEG_B, "B"), special(SEG_B, "<sep>"),
                         special(SEG_CLS, "<cls>")],
                "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]}
                                   for t, i in (("<cls>", CLS_ID), ("<sep>", SEP_ID))},
            },
            "decoder": metaspace,
            "model": {"type": "Unigram", "unk_id": UNK_ID, "byte_fallback": False,
                      "vocab": [[self.sp.IdToPiece(i), self.sp.GetScore(i)] for i in range(self.vocab_size)]},
        }

    # ---------------------------------------------------------------- basic properties
    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_tokens(self) -> list[str]:
        return list(SPECIAL_TOKENS)

    @property
    def all_special_ids(self) -> list[int]:
        return list(range(len(SPECIAL_TOKENS)))

    def get_vocab(self) -> dict[str, int]:
        return {self.sp.IdToPiece(i): i for i in range(self.vocab_size)}

    # ---------------------------------------------------------------- text -> pieces -> ids
    def preprocess_text(self, text: str) -> str:
        if self.remove_space:
            text = " ".join(text.strip().split())
        text = text.replace("``", '"').replace("''", '"')
        if not self.keep_accents:
            text = unicodedata.normalize("NFKD", text)
            text = "".join(c for c in text if not unicodedata.combining(c))
        if self.do_lower_case:
            text = text.lower()
        return text

    def tokenize(self, text: str) -> list[str]:
        """Pieces of ``text``. Special tokens written in the text (``"a <mask> b"``) stay whole, as in
        ``transformers``; the rest is split with the original's rule for a digit run followed by a
        comma ("9," -> "9", ",")."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {_kind(text)}")
        if "<" not in text:  # no special token written in it (the common case, and faster)
            return self._sentencepiece_pieces(text)
        pieces: list[str] = []
        for part in _SPECIAL_TOKEN_SPLIT.split(text):
            if part in SPECIAL_TOKENS:
                pieces.append(part)
            elif part:
                pieces.extend(self._sentencepiece_pieces(part))
        return pieces

    def _sentencepiece_pieces(self, text: str) -> list[str]:
        out: list[str] = []
        for piece in self.sp.EncodeAsPieces(self.preprocess_text(text)):
            if len(piece) > 1 and piece[-1] == "," and piece[-2].isdigit():
                sub = self.sp.EncodeAsPieces(piece[:-1].replace(_UNDERLINE, ""))
                if piece[0] != _UNDERLINE and sub and sub[0].startswith(_UNDERLINE):
                    sub[0] = sub[0][1:] if len(sub[0]) > 1 else sub[0]
                    if not sub[0]:
                        sub = sub[1:]
                out.extend(sub)
                out.append(piece[-1])
            else:
                out.append(piece)
        return out

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        """Id of one piece (an int) or of each piece in a list; unknown pieces give ``<unk>``'s id."""
        if isinstance(tokens, str):
            return self.sp.PieceToId(tokens)
        if not isinstance(tokens, Iterable):
            raise TypeError(f"tokens must be a str or a list of str, got {_kind(tokens)}")
        ids = []
        for i, token in enumerate(tokens):
            if not isinstance(token, str):
                raise TypeError(f"tokens[{i}] must be a str, got {_kind(token)}")
            ids.append(self.sp.PieceToId(token))
        return ids

    def convert_ids_to_tokens(self, ids: int | Iterable[int] | torch.Tensor | np.ndarray,
                              skip_special_tokens: bool = False) -> str | list[str]:
        """Piece of one id (a str) or of each id in a sequence; out-of-range ids raise ValueError."""
        id_list, is_scalar = self._id_list(ids, "ids")
        if is_scalar:
            return self.sp.IdToPiece(id_list[0])
        return [self.sp.IdToPiece(i) for i in id_list if not (skip_special_tokens and i < len(SPECIAL_TOKENS))]

    def _id_list(self, ids, name: str) -> tuple[list[int], bool]:
        """``ids`` (an int, a sequence, a 0-d/1-d tensor or array) as a list of in-range ints, and
        whether it was a single id."""
        if isinstance(ids, (torch.Tensor, np.ndarray)):
            if ids.ndim > 1:
                raise TypeError(f"{name} must be one sequence of ids, got a {ids.ndim}-d array "
                                f"(use batch_decode for a batch)")
            is_scalar, ids = ids.ndim == 0, ids.tolist()
            id_list = [ids] if is_scalar else ids
        elif isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            is_scalar, id_list = True, [ids]
        else:
            is_scalar, id_list = False, list(ids)
        as_ints = []
        for value in id_list:
            try:
                as_ints.append(operator.index(value))
            except TypeError:
                raise TypeError(f"{name} must be ints, got {value!r:.60} ({_kind(value)})") from None
        id_list = as_ints
        bad = sorted({i for i in id_list if not 0 <= i < self.vocab_size})
        if bad:
            raise ValueError(f"{name} contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:10]}"
                             + (f" and {len(bad) - 10} more" if len(bad) > 10 else ""))
        return id_list, is_scalar

    # ---------------------------------------------------------------- encoding
    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True, *,
               padding: bool | str = False, truncation: bool | str | None = None,
               max_length: int | None = None, return_tensors: str | None = None) -> list[int] | torch.Tensor:
        """Ids of one text (or pair), as ``tok(text, ...)["input_ids"]``."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes one text: text must be a str, got {_kind(text)} "
                            f"(call the tokenizer on a list to encode a batch)")
        if padding or return_tensors is not None:
            return self(text, text_pair, add_special_tokens=add_special_tokens, padding=padding,
                        truncation=truncation, max_length=max_length, return_tensors=return_tensors,
                        return_token_type_ids=False, return_attention_mask=False)["input_ids"]
        texts, pairs, _ = _split_inputs(text, text_pair)
        strategy = _truncation_strategy(truncation, None, max_length)
        return self._encode_one(texts[0], pairs[0], add_special_tokens, strategy, max_length)[0]

    def _encode_one(self, text: str, text_pair: str | None, add_special_tokens: bool,
                    truncation: str | None, max_length: int | None) -> tuple[list[int], list[int]]:
        """Ids and token type ids of one text (or pair), truncated, with XLNet's special tokens."""
        a = self.convert_tokens_to_ids(self.tokenize(text))
        b = self.convert_tokens_to_ids(self.tokenize(text_pair)) if text_pair is not None else None
        if truncation is not None and max_length is not None:
            n_special = (3 if b is not None else 2) if add_special_tokens else 0
            a, b = _truncate(a, b, max_length - n_special, truncation, max_length)
        if not add_special_tokens:
            ids = a + (b or [])
            types = [SEG_A] * len(a) + [SEG_B] * len(b or [])
        elif b is None:
            ids = a + [SEP_ID, CLS_ID]
            types = [SEG_A] * (len(a) + 1) + [SEG_CLS]
        else:
            ids = a + [SEP_ID] + b + [SEP_ID, CLS_ID]
            types = [SEG_A] * (len(a) + 1) + [SEG_B] * (len(b) + 1) + [SEG_CLS]
        return ids, types

    def __call__(self, text: str | Sequence[str] | Sequence[tuple[str, str]] | None = None,
                 text_pair: str | Sequence[str] | None = None, *, add_special_tokens: bool = True,
                 padding: bool | str = False, truncation: bool | str | None = None,
                 max_length: int | None = None, pad_to_multiple_of: int | None = None,
                 padding_side: str | None = None, return_tensors: str | None = None,
                 return_token_type_ids: bool | None = None,
                 return_attention_mask: bool | None = None) -> BatchEncoding:
        """Encode one text, a pair, or a batch (a list of texts, with an optional list of pairs, or a
        list of ``(text, text_pair)`` tuples), like ``transformers``' tokenizers.

        Returns a :class:`BatchEncoding` with ``input_ids``, ``token_type_ids`` and ``attention_mask``:
        python lists by default (one list for a single text, a list of lists for a batch), or
        ``(B, L)`` tensors with ``return_tensors="pt"`` (``"np"``: numpy arrays). No padding by
        default; ``padding=True``/``"longest"``/``"max_length"`` pads on ``padding_side`` (left).
        ``truncation=True``/``"longest_first"``/``"only_first"``/``"only_second"`` cuts to
        ``max_length``, keeping the special tokens; a ``max_length`` with neither padding nor
        ``truncation`` given truncates longest-first, as in ``transformers``.
        """
        texts, pairs, is_batch = _split_inputs(text, text_pair)
        # transformers' PaddingStrategy / TruncationStrategy / TensorType enums stand for their values
        padding, truncation, return_tensors = (getattr(option, "value", option)
                                               for option in (padding, truncation, return_tensors))
        _check_lengths(max_length, pad_to_multiple_of, return_tensors)
        side = _check_padding_side(padding_side if padding_side is not None else self.padding_side)
        try:
            padding_mode = _PADDING_MODES[padding]
        except (KeyError, TypeError):
            raise ValueError(f"padding must be True, False, 'longest', 'max_length' or 'do_not_pad', "
                             f"got {padding!r}") from None
        if padding_mode == "max_length" and max_length is None:
            raise ValueError("padding='max_length' needs max_length")
        strategy = _truncation_strategy(truncation, padding_mode, max_length)

        encoded = [self._encode_one(t, p, add_special_tokens, strategy, max_length) for t, p in zip(texts, pairs)]
        target = None
        if padding_mode == "longest":
            target = max((len(ids) for ids, _ in encoded), default=0)
        elif padding_mode == "max_length":
            target = max_length
        if target is not None and pad_to_multiple_of:
            target = math.ceil(target / pad_to_multiple_of) * pad_to_multiple_of

        columns = _padded_columns(encoded, target, side)
        if return_token_type_ids is False:
            del columns["token_type_ids"]
        if return_attention_mask is False:
            del columns["attention_mask"]
        if return_tensors is None:
            return BatchEncoding({k: (v if is_batch else v[0]) for k, v in columns.items()})
        return _as_arrays(columns, return_tensors)

    # ---------------------------------------------------------------- decoding
    def decode(self, token_ids: int | Iterable[int] | torch.Tensor | np.ndarray,
               skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        """Text of a sequence of ids, as ``transformers`` decodes it: special tokens are written out
        (``"a b<sep><cls>"``) unless ``skip_special_tokens=True``; out-of-range ids raise ValueError."""
        ids, _ = self._id_list(token_ids, "token_ids")
        if skip_special_tokens:
            ids = [i for i in ids if i >= len(SPECIAL_TOKENS)]
        parts = []
        for position, token_id in enumerate(ids):
            piece = self.sp.IdToPiece(token_id)
            if token_id >= len(SPECIAL_TOKENS):  # the word-start mark is a space, none at the start
                piece = piece.replace(_UNDERLINE, "" if position == 0 else " ")
            parts.append(piece)
        text = "".join(parts)
        return _clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    def batch_decode(self, sequences: Iterable[Iterable[int]] | torch.Tensor | np.ndarray,
                     skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> list[str]:
        """:meth:`decode` of each sequence (a list of id lists or a 2-d tensor)."""
        if isinstance(sequences, (torch.Tensor, np.ndarray)) and sequences.ndim != 2:
            raise TypeError(f"batch_decode takes a 2-d tensor or a list of id lists, got a {sequences.ndim}-d one")
        return [self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces) for ids in sequences]


def _check_lengths(max_length, pad_to_multiple_of, return_tensors) -> None:
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                   or max_length <= 0):
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of <= 0):
        raise ValueError(f"pad_to_multiple_of must be a positive int, got {pad_to_multiple_of!r}")
    if return_tensors not in (None, "pt", "np"):
        raise ValueError(f"return_tensors must be None, 'pt' or 'np', got {return_tensors!r}")


def _padded_columns(encoded: list[tuple[list[int], list[int]]], target: int | None, side: str) -> dict[str, list]:
    """``input_ids``, ``token_type_ids`` and ``attention_mask`` lists of the encoded ``(ids, types)``,
    each padded on ``side`` to ``target`` tokens (None: not padded)."""
    columns: dict[str, list] = {"input_ids": [], "token_type_ids": [], "attention_mask": []}
    for ids, types in encoded:
        n_pad = max(0, target - len(ids)) if target is not None else 0
        rows = ((ids, PAD_ID, "input_ids"), (types, SEG_PAD, "token_type_ids"),
                ([1] * len(ids), 0, "attention_mask"))
        for values, pad_value, key in rows:
            pads = [pad_value] * n_pad
            columns[key].append(pads + values if side == "left" else values + pads)
    return columns


def _as_arrays(columns: dict[str, list], return_tensors: str) -> BatchEncoding:
    """The columns as ``(B, L)`` tensors (``"pt"``) or numpy arrays (``"np"``); rows must be equally long."""
    lengths = sorted({len(ids) for ids in columns["input_ids"]})
    if len(lengths) > 1:
        raise ValueError(f"cannot make a tensor of sequences of different lengths ({lengths[0]} to "
                         f"{lengths[-1]}): pass padding=True, or padding='max_length' with truncation=True")
    width = lengths[0] if lengths else 0
    if return_tensors == "pt":
        return BatchEncoding({k: torch.tensor(v, dtype=torch.long).reshape(len(v), width)
                              for k, v in columns.items()})
    return BatchEncoding({k: np.array(v, dtype=np.int64).reshape(len(v), width) for k, v in columns.items()})


def _check_padding_side(side: str) -> str:
    if side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
    return side


def _split_inputs(text, text_pair) -> tuple[list[str], list[str | None], bool]:
    """``(texts, pairs, is_batch)`` from the tokenizer's ``text`` and ``text_pair`` arguments; a
    TypeError names the argument of the wrong type."""
    if isinstance(text, str):
        if text_pair is not None and not isinstance(text_pair, str):
            raise TypeError(f"text_pair must be a str when text is a str, got {_kind(text_pair)}")
        return [text], [text_pair], False
    if not isinstance(text, (list, tuple)):
        raise TypeError(f"text must be a str, a list of str or a list of (text, text_pair) tuples, "
                        f"got {_kind(text)}")
    if text_pair is None and text and all(isinstance(item, (tuple, list)) for item in text):
        for i, item in enumerate(text):
            if len(item) != 2 or not all(isinstance(s, str) for s in item):
                raise TypeError(f"text[{i}] must be a (text, text_pair) pair of str, got {item!r:.80}")
        return [a for a, _ in text], [b for _, b in text], True
    for i, item in enumerate(text):
        if not isinstance(item, str):
            raise TypeError(f"text[{i}] must be a str, got {_kind(item)}")
    if text_pair is None:
        return list(text), [None] * len(text), True
    if not isinstance(text_pair, (list, tuple)):
        raise TypeError(f"text_pair must be a list of str when text is a list, got {_kind(text_pair)}")
    if len(text_pair) != len(text):
        raise ValueError(f"text_pair has {len(text_pair)} entries, text has {len(text)}")
    for i, item in enumerate(text_pair):
        if not isinstance(item, str):
            raise TypeError(f"text_pair[{i}] must be a str, got {_kind(item)}")
    return list(text), list(text_pair), True


def _truncation_strategy(truncation, padding_mode: str | None, max_length: int | None) -> str | None:
    """The truncation to apply; ``None`` (not given) with a ``max_length`` and no padding truncates
    longest-first, as in ``transformers``."""
    if truncation is None:
        return "longest_first" if max_length is not None and padding_mode is None else None
    try:
        return _TRUNCATION_MODES[truncation]
    except (KeyError, TypeError):
        raise ValueError(f"truncation must be True, False, 'longest_first', 'only_first', 'only_second' or "
                         f"'do_not_truncate', got {truncation!r}") from None


def _truncate(a: list[int], b: list[int] | None, budget: int, strategy: str,
              max_length: int) -> tuple[list[int], list[int] | None]:
    """Cut ``a`` (and ``b``) to ``budget`` ids in all. ``longest_first`` keeps
    ``min(shorter, budget // 2)`` of the shorter one (the first on a tie) and fills the rest with the
    longer one, as ``tokenizers`` does."""
    if budget < 0:
        raise ValueError(f"max_length={max_length} leaves no room for the special tokens")
    len_b = len(b) if b is not None else 0
    excess = len(a) + len_b - budget
    if excess <= 0:
        return a, b
    if strategy == "longest_first":
        if b is None:
            return a[:budget], None
        if len(a) > len(b):
            keep_b = min(len(b), budget // 2)
            return a[:budget - keep_b], b[:keep_b]
        keep_a = min(len(a), budget // 2)
        return a[:keep_a], b[:budget - keep_a]
    if strategy == "only_second" and b is None:
        raise ValueError("truncation='only_second' needs a text_pair")
    name, cut = ("text", a) if strategy == "only_first" else ("text_pair", b)
    if excess >= len(cut):
        raise ValueError(f"max_length={max_length} is too short: truncation={strategy!r} would have to remove "
                         f"{excess} of the {len(cut)} tokens of {name}")
    cut = cut[:len(cut) - excess]
    return (cut, b) if strategy == "only_first" else (a, cut)


def _clean_up_tokenization(text: str) -> str:
    """Remove the space before punctuation and English contractions (``transformers``' clean-up)."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                           (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(spaced, joined)
    return text


def _read_varint(buffer: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buffer[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _protobuf_fields(buffer: bytes) -> Iterable[tuple[int, int | bytes]]:
    """``(field number, value)`` of each field of a serialized protobuf message (wire format only)."""
    pos = 0
    while pos < len(buffer):
        key, pos = _read_varint(buffer, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _read_varint(buffer, pos)
        elif wire_type == 2:
            size, pos = _read_varint(buffer, pos)
            value, pos = buffer[pos:pos + size], pos + size
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            value, pos = buffer[pos:pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type}")
        yield field, value


def precompiled_charsmap(model_proto: bytes) -> bytes:
    """The normalization table (``normalizer_spec.precompiled_charsmap``) of a serialized
    sentencepiece model, read without protobuf; ``b""`` when the model has none."""
    for field, value in _protobuf_fields(model_proto):
        if field == 3 and isinstance(value, bytes):  # ModelProto.normalizer_spec
            for inner_field, inner_value in _protobuf_fields(value):
                if inner_field == 2 and isinstance(inner_value, bytes):  # NormalizerSpec.precompiled_charsmap
                    return inner_value
    return b""


def train_tokenizer(files_or_texts: str | os.PathLike | Iterable[str], vocab_size: int,
                    out_dir: str | os.PathLike, *, character_coverage: float = 0.9995,
                    max_sentences: int = 2_000_000, **tokenizer_kwargs) -> XLNetTokenizer:
    """Train a unigram sentencepiece model with XLNet's special ids; writes ``out_dir/spiece.model``
    and the files :meth:`XLNetTokenizer.save_pretrained` adds for ``transformers``.

    ``files_or_texts``: a path, a list of paths, or an iterable of text lines. The files are written
    into a temporary sibling directory first and moved in (``spiece.model`` last), so a failure (a
    full disk) leaves ``out_dir`` without a partial tokenizer; other files in ``out_dir`` are kept.
    Fewer pieces than ``vocab_size`` (the text holds too few distinct ones) are logged as a warning
    saying how varied the text is.
    """
    import sentencepiece as spm

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    if isinstance(files_or_texts, (str, os.PathLike)):
        files_or_texts = [files_or_texts]
    items = list(files_or_texts)
    kwargs = {}
    if items and all(os.path.isfile(os.fspath(x)) for x in items):
        kwargs["input"] = ",".join(os.fspath(x) for x in items)
    else:
        kwargs["sentence_iterator"] = iter(str(x) for x in items if str(x).strip())
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.Train(
            **kwargs,
            model_writer=model,
            model_type="unigram",
            vocab_size=vocab_size,
            character_coverage=character_coverage,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
            control_symbols=["<cls>", "<sep>", "<mask>", "<eod>", "<eop>"],
            hard_vocab_limit=False,
            minloglevel=2,
        )
    except RuntimeError as exc:  # sentencepiece's CHECK failures: the text or the size cannot give a tokenizer
        from .errors import UsageError

        text = str(exc)
        if "smaller than required_chars" in text:
            need = re.search(r"(\d+) vs (\d+)", text)
            raise UsageError(f"--vocab-size {vocab_size} is below the {need.group(2) if need else 'more'} pieces the "
                             "text's characters and the special tokens need: ask for more") from None
        if "sentences_.empty()" in text:
            raise UsageError("no line of the text is usable for the tokenizer (sentencepiece skips lines longer "
                             "than 4192 bytes): break long lines") from None
        raise UsageError(f"sentencepiece could not train a tokenizer: {text.strip()}") from None
    pieces = _piece_count(model.getvalue())
    if pieces < vocab_size:
        lines = items if "sentence_iterator" in kwargs else _file_lines(items)
        logger.warning("the tokenizer has %d pieces, fewer than the %d asked: %s", pieces, vocab_size,
                       text_variety(lines))
    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        path = os.path.join(tmp, SPIECE_NAME)
        with open(path, "wb") as f:
            try:
                f.write(model.getvalue())
            except OSError as exc:  # write() names no file
                raise OSError(exc.errno, exc.strerror, path) from None
        XLNetTokenizer(path, **tokenizer_kwargs).save_pretrained(tmp)
        for name in sorted(TOKENIZER_FILES, key=lambda n: n == SPIECE_NAME):  # spiece.model last
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return XLNetTokenizer(os.path.join(out_dir, SPIECE_NAME), **tokenizer_kwargs)


def _piece_count(model_proto: bytes) -> int:
    """The number of pieces of a serialized sentencepiece model (``ModelProto.pieces``, field 1)."""
    return sum(1 for field, _ in _protobuf_fields(model_proto) if field == 1)


def _file_lines(paths: Iterable) -> Iterable[str]:
    for path in paths:
        with open(os.fspath(path), encoding="utf-8", errors="replace") as f:
            yield from f


def text_variety(lines: Iterable[str]) -> str:
    """What limits a vocabulary learnt from ``lines``, in words: how many distinct whitespace-separated
    words and characters they hold (a vocabulary of more pieces needs more, or more varied, text)."""
    words: set[str] = set()
    chars: set[str] = set()
    for line in lines:
        for word in str(line).split():
            if word not in words:
                words.add(word)
                chars.update(word)
    return (f"the text holds only {len(words):,} distinct words of {len(chars):,} distinct characters, too few "
            "distinct pieces for more: train on more (or more varied) text, or ask for fewer")
