"""Transformer-XL's word-level vocabulary, read without unpickling objects.

transformers 4.x stores the vocabulary as ``vocab.pkl``: a pickle of its tokenizer's ``__dict__``,
which holds, besides the plain ``idx2sym`` list and ``sym2idx`` dict, objects (Moses tokenizers,
compiled patterns, ``AddedToken``...). Loading a pickle can run any code, which is why transformers
gated it behind ``TRUST_REMOTE_CODE`` and then deleted the model. ``read_vocab_pickle`` reads it with
an unpickler that constructs only plain values (str, int, float, bytes, list, tuple, dict, set) and
``collections.Counter``/``OrderedDict``; every other object the file names is neither imported nor
called: it becomes an inert ``OpaqueObject`` placeholder. The vocabulary fields must then be plain,
else a ``ValueError`` says which one is not. ``save_pretrained`` writes the safe format: ``vocab.txt``
(one symbol per line, which 4.x also reads) and ``tokenizer_config.json``.

Text becomes symbols as in 4.x: Moses tokenization and ``@,@``/``@.@`` number splitting when
``sacremoses`` is installed, else the original code's split at ``delimiter`` (whitespace), said once.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import os
import pickle
import re

logger = logging.getLogger(__name__)

VOCAB_PKL, VOCAB_TXT, CONFIG_NAME = "vocab.pkl", "vocab.txt", "tokenizer_config.json"
_SAFE_GLOBALS = {("collections", "Counter"): collections.Counter,
                 ("collections", "OrderedDict"): collections.OrderedDict,
                 ("builtins", "set"): set, ("builtins", "frozenset"): frozenset}
_NUMBER_SPLIT = (re.compile(r"(?<=\d)[,.](?=\d)"), r" @\g<0>@ ")
_NUMBER_JOIN = ((re.compile(r" @\,@ "), ","), (re.compile(r" @\.@ "), "."))
_WORD_OR_MARK = re.compile(r"\w+|[^\w\s]")  # split_punctuation: words, and each other mark on its own
_SPACE_BEFORE_MARK = re.compile(r" ([.,;:!?')\]}])")
_warned: set[str] = set()


class OpaqueObject:
    """Stands for an object of a class a vocabulary pickle names; nothing of it is imported or run.
    ``qualname``: what the pickle named; ``args``/``state``: what it passed (inert values)."""

    qualname = "?"

    def __init__(self, *args, **kwargs):
        self.args, self.state = args, None

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __setstate__(self, state) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<not loaded: {self.qualname}>"


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source, self.opaque = source, set()

    def find_class(self, module: str, name: str):
        if (module, name) in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[(module, name)]
        qualname = f"{module}.{name}"
        self.opaque.add(qualname)
        return type("Opaque", (OpaqueObject,), {"qualname": qualname})

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"{self.source}: persistent ids are not supported")


def read_vocab_pickle(path: str) -> dict:
    """The ``dict`` a 4.x ``vocab.pkl`` holds, with every object that is not a plain value or a
    ``Counter``/``OrderedDict`` left as an ``OpaqueObject`` (never constructed)."""
    with open(path, "rb") as f:
        data = f.read()
    unpickler = _RestrictedUnpickler(io.BytesIO(data), path)
    try:
        value = unpickler.load()
    except Exception as exc:  # a broken or foreign file: say so, without a traceback into pickle
        raise ValueError(f"{path}: not a readable vocabulary pickle ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a pickled dict (transformers' TransfoXLTokenizer state), got "
                         f"{type(value).__name__}")
    if unpickler.opaque:
        logger.info("%s: left unloaded (not needed, never constructed): %s", path, ", ".join(sorted(unpickler.opaque)))
    return value


def _plain_symbols(value, source: str) -> list[str]:
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    if value is None:
        got = "nothing (no 'idx2sym' entry)"
    elif isinstance(value, OpaqueObject):
        got = f"an object of {value.qualname} (not loaded)"
    else:
        got = f"a {type(value).__name__}" + (" holding other values" if isinstance(value, (list, tuple)) else "")
    raise ValueError(f"{source}: 'idx2sym' must be a list of strings, got {got}")


def detokenize_numbers(text: str) -> str:
    for pattern, repl in _NUMBER_JOIN:
        text = pattern.sub(repl, text)
    return text


class TransfoXLTokenizer:
    """Word-level vocabulary: ``encode(text) -> ids``, ``decode(ids) -> text``.

    idx2sym: the symbols, by id. lower_case: lower-case the text first. delimiter: the original
    split (None: whitespace; ``""``: characters). unk_token/eos_token: the unknown and end-of-line
    symbols. moses: tokenize with sacremoses as 4.x (None: when it is installed).
    split_punctuation: without Moses, split at whitespace and put every mark that is not a letter or
    a digit on its own (``earth.`` -> ``earth .``), as Moses does for most text (``from_corpus``).
    """

    def __init__(self, idx2sym: list[str], lower_case: bool = False, delimiter: str | None = None,
                 unk_token: str = "<unk>", eos_token: str = "<eos>", special: list[str] | None = None,
                 language: str = "en", moses: bool | None = None, split_punctuation: bool = False):
        if not idx2sym:
            raise ValueError("the vocabulary is empty")
        self.idx2sym = list(idx2sym)
        self.sym2idx = {s: i for i, s in enumerate(self.idx2sym)}
        if len(self.sym2idx) != len(self.idx2sym):
            raise ValueError("the vocabulary holds a symbol twice")
        self.lower_case, self.delimiter, self.language = bool(lower_case), delimiter, language
        self.unk_token, self.eos_token, self.special = unk_token, eos_token, list(special or [])
        self.unk_id = next((self.sym2idx[s] for s in (unk_token, "<unk>", "<UNK>") if s in self.sym2idx), None)
        self.eos_id = self.sym2idx.get(eos_token)
        self.moses = moses  # as given: None (when sacremoses is installed), True or False
        self.split_punctuation = bool(split_punctuation)
        self.name_or_path: str | None = None  # the directory it was read from
        self._moses = self._moses_tools(moses)

    # -- loading and saving ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, **kwargs) -> "TransfoXLTokenizer":
        """From ``vocab.txt`` (+ ``tokenizer_config.json``) or a 4.x ``vocab.pkl`` (read safely)."""
        directory = os.fspath(directory)
        if os.path.isfile(directory):  # a vocab.pkl or vocab.txt given directly
            directory, name = os.path.split(directory)
            paths = [os.path.join(directory, name)]
        else:
            paths = [os.path.join(directory, n) for n in (VOCAB_TXT, VOCAB_PKL)]
        options = _read_config(os.path.join(directory, CONFIG_NAME))
        for path in paths:
            if os.path.exists(path):
                break
        else:
            raise FileNotFoundError(f"no {VOCAB_TXT} or {VOCAB_PKL} in {directory}")
        if path.endswith(".pkl"):
            state = read_vocab_pickle(path)
            idx2sym = _plain_symbols(state.get("idx2sym"), path)
            for key in ("lower_case", "delimiter", "special"):
                if key in state and not isinstance(state[key], OpaqueObject):
                    options.setdefault(key, state[key])
        else:
            idx2sym = _read_symbols(path)
        keep = {"lower_case", "delimiter", "unk_token", "eos_token", "special", "language", "moses",
                "split_punctuation"}
        options = {k: _plain_token(v) for k, v in options.items() if k in keep}
        tokenizer = cls(idx2sym, **{**options, **kwargs})
        tokenizer.name_or_path = directory
        return tokenizer

    @classmethod
    def from_corpus(cls, lines, vocab_size: int | None = None, lower_case: bool = False,
                    split_punctuation: bool = True) -> "TransfoXLTokenizer":
        """A vocabulary built from text lines as the original code's ``build_vocab``: ``<eos>`` and
        ``<unk>`` first, then the symbols by descending count (ties in order of first appearance), at
        most ``vocab_size`` in all (the rest become ``<unk>``; fewer, with a warning, when the text holds
        fewer distinct symbols). Split at whitespace and, with
        ``split_punctuation``, at marks, never with Moses (``moses=False``, saved): the same ids
        wherever it is read (raw text; WikiText-style text comes split already)."""
        special = ["<eos>", "<unk>"]
        if vocab_size is not None and vocab_size < len(special) + 1:
            raise ValueError(f"vocab_size must be at least {len(special) + 1} (<eos>, <unk> and a word), "
                             f"got {vocab_size}")
        options = dict(lower_case=lower_case, special=special, moses=False, split_punctuation=split_punctuation)
        splitter = cls(list(special), **options)
        counts: collections.Counter = collections.Counter()
        for line in lines:
            counts.update(splitter.tokenize(line))
        words = [w for w, _ in counts.most_common() if w not in special]
        if vocab_size is not None:
            if len(special) + len(words) < vocab_size:
                logger.warning("the vocabulary has %d symbols, fewer than the %d asked: the text holds only %d "
                               "distinct symbols besides %s (train on more, or more varied, text for more)",
                               len(special) + len(words), vocab_size, len(words), " ".join(special))
            words = words[:vocab_size - len(special)]
        return cls(special + words, **options)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """``vocab.txt`` and ``tokenizer_config.json`` (transformers 4.x's ``TransfoXLTokenizer`` reads
        them too)."""
        bad = [s for s in self.idx2sym if not s or s != s.strip() or len(s.split()) != 1]
        if bad:
            raise ValueError(f"symbols with whitespace cannot be written to {VOCAB_TXT}: {bad[:5]}")
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, VOCAB_TXT), "w", encoding="utf-8") as f:
            f.write("".join(s + "\n" for s in self.idx2sym))
        config = {"tokenizer_class": "TransfoXLTokenizer", "lower_case": self.lower_case, "delimiter": self.delimiter,
                  "unk_token": self.unk_token, "eos_token": self.eos_token, "special": self.special,
                  "language": self.language}
        if self.moses is not None:  # how text is split, when it was chosen (4.x always uses Moses)
            config["moses"] = self.moses
        if self.split_punctuation:
            config["split_punctuation"] = True
        with open(os.path.join(directory, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2)

    # -- text <-> ids ------------------------------------------------------------------------------

    def _moses_tools(self, moses: bool | None):
        if moses is False or self.delimiter == "":
            return None
        try:
            import sacremoses
        except ImportError:
            if moses:
                raise ImportError("moses=True needs sacremoses: pip install sacremoses") from None
            if "moses" not in _warned:
                _warned.add("moses")
                logger.warning("sacremoses is not installed: text is split at whitespace as the original "
                               "Transformer-XL code does (transformers 4.x used Moses tokenization: pip install "
                               "sacremoses for its ids)")
            return None
        return (sacremoses.MosesPunctNormalizer(self.language), sacremoses.MosesTokenizer(self.language),
                sacremoses.MosesDetokenizer(self.language))

    @property
    def vocab_size(self) -> int:
        return len(self.idx2sym)

    def __len__(self) -> int:
        return len(self.idx2sym)

    def tokenize(self, text: str, add_eos: bool = False) -> list[str]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        line = text.strip()
        if self.lower_case:
            line = line.lower()
        if self.delimiter == "":
            symbols = list(line)
        elif self._moses is not None:
            normalizer, tokenizer, _ = self._moses
            words = tokenizer.tokenize(normalizer.normalize(line), aggressive_dash_splits=True, return_str=False,
                                       escape=False, protected_patterns=[self.eos_token, self.unk_token])
            pattern, repl = _NUMBER_SPLIT
            symbols = [part for w in words for part in pattern.sub(repl, w).split()]
        elif self.split_punctuation and self.delimiter is None:
            symbols = _WORD_OR_MARK.findall(line)
        else:
            symbols = line.split(self.delimiter)
        return symbols + [self.eos_token] if add_eos else symbols

    def convert_tokens_to_ids(self, symbols: list[str]) -> list[int]:
        ids = []
        for s in symbols:
            i = self.sym2idx.get(s, self.unk_id)
            if i is None:
                raise ValueError(f"{s!r} is not in the vocabulary, which has no <unk> symbol")
            ids.append(i)
        return ids

    def convert_ids_to_tokens(self, ids) -> list[str]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < len(self.idx2sym)]
        if bad:
            raise ValueError(f"ids out of the vocabulary [0, {len(self.idx2sym)}): {bad[:5]}")
        return [self.idx2sym[i] for i in ids]

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        return self.convert_tokens_to_ids(self.tokenize(text, add_eos=add_eos))

    def decode(self, ids) -> str:
        tokens = self.convert_ids_to_tokens(ids)
        text = self._moses[2].detokenize(tokens) if self._moses is not None else " ".join(tokens)
        if self._moses is None and self.split_punctuation:
            text = _SPACE_BEFORE_MARK.sub(r"\1", text)
        return detokenize_numbers(text).strip()

    def __call__(self, text: str, return_tensors: str | None = None) -> dict:
        ids = self.encode(text)
        if return_tensors is None:
            return {"input_ids": ids}
        if return_tensors != "pt":
            raise ValueError(f"return_tensors must be None or 'pt', got {return_tensors!r}")
        import torch

        return {"input_ids": torch.tensor([ids], dtype=torch.long)}


def _read_symbols(path: str) -> list[str]:
    """The first column of each line of a ``vocab.txt`` (4.x's and the original's format)."""
    with open(path, encoding="utf-8") as f:
        return [line.split()[0] for line in f if line.strip()]


def _read_config(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    return value if isinstance(value, dict) else {}


def _plain_token(value):
    """4.x writes special tokens as strings or as ``{"content": ...}`` dicts."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return value
