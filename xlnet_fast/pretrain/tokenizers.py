"""The two tokenizers a token stream is prepared with, behind the few operations that preparing, reading
and checking token streams need:

- ``sentencepiece``: XLNet's ``XLNetTokenizer`` (``spiece.model``; XLNet's special ids). Each line of
  a document is encoded without special tokens, each document ends with ``<eod>``. Both models train
  on it.
- ``word``: Transformer-XL's word-level ``TransfoXLTokenizer`` (``vocab.txt``), e.g. built from the
  corpus (``TransfoXLTokenizer.from_corpus``, the original code's ``build_vocab``). Each line is its
  symbols and ``<eos>`` (the original corpus encoding), each document ends with one more ``<eos>``
  (the blank line the original encodes between documents). Transformer-XL only.

``load_tokenizer_dir`` reads either from a directory by the file it holds.
"""

from __future__ import annotations

import hashlib
import json
import os

from ..transfo_xl.tokenizer import CONFIG_NAME as WORD_CONFIG_NAME
from ..transfo_xl.tokenizer import VOCAB_PKL, VOCAB_TXT, TransfoXLTokenizer
from .tokenizer import EOD_ID, SPIECE_NAME, TOKENIZER_FILES, XLNetTokenizer

SENTENCEPIECE, WORD = "sentencepiece", "word"
KINDS = (SENTENCEPIECE, WORD)
WORD_TOKENIZER_FILES = (VOCAB_TXT, WORD_CONFIG_NAME)  # what TransfoXLTokenizer.save_pretrained writes
ALL_TOKENIZER_FILES = tuple(dict.fromkeys(TOKENIZER_FILES + WORD_TOKENIZER_FILES))

Tokenizer = XLNetTokenizer | TransfoXLTokenizer


def tokenizer_kind(tokenizer: Tokenizer) -> str:
    return WORD if isinstance(tokenizer, TransfoXLTokenizer) else SENTENCEPIECE


def holds_tokenizer(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a tokenizer of either kind."""
    return any(os.path.isfile(os.path.join(directory, n)) for n in (SPIECE_NAME, VOCAB_TXT, VOCAB_PKL))


def load_tokenizer_dir(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer in ``path``: a directory with ``spiece.model`` (sentencepiece) or ``vocab.txt``
    (word-level), or one of those files. ``FileNotFoundError``/``ValueError`` when there is none or it
    is unreadable."""
    path = os.fspath(path)
    word = (os.path.basename(path) in (VOCAB_TXT, VOCAB_PKL) if os.path.isfile(path) else
            os.path.isdir(path) and not os.path.isfile(os.path.join(path, SPIECE_NAME))
            and any(os.path.isfile(os.path.join(path, n)) for n in (VOCAB_TXT, VOCAB_PKL)))
    # anything else is read as sentencepiece: a missing one is an error naming spiece.model
    return TransfoXLTokenizer.from_pretrained(path) if word else XLNetTokenizer.from_pretrained(path)


def tokenizer_files(tokenizer: Tokenizer) -> tuple[str, ...]:
    """The files ``save_pretrained`` writes."""
    return WORD_TOKENIZER_FILES if tokenizer_kind(tokenizer) == WORD else TOKENIZER_FILES


def tokenizer_options(tokenizer: Tokenizer) -> dict:
    """The options besides the model file (or the symbols) that change what ``encode_line`` returns."""
    if tokenizer_kind(tokenizer) == WORD:
        return {"lower_case": tokenizer.lower_case, "delimiter": tokenizer.delimiter, "moses": tokenizer.moses,
                "split_punctuation": tokenizer.split_punctuation, "unk_token": tokenizer.unk_token,
                "eos_token": tokenizer.eos_token, "language": tokenizer.language}
    return {"do_lower_case": tokenizer.do_lower_case, "remove_space": tokenizer.remove_space,
            "keep_accents": tokenizer.keep_accents}


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """sha256 of what decides the ids: the sentencepiece model's bytes, or the word-level symbols,
    and the encoding options."""
    h = hashlib.sha256(json.dumps(tokenizer_options(tokenizer), sort_keys=True).encode())
    if tokenizer_kind(tokenizer) == WORD:
        h.update(b"word:" + "\n".join(tokenizer.idx2sym).encode())
        return h.hexdigest()
    with open(tokenizer.model_file, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def tokenizer_source(tokenizer: Tokenizer) -> str | None:
    """The file or directory the tokenizer was read from (None: built in memory)."""
    if tokenizer_kind(tokenizer) == WORD:
        return tokenizer.name_or_path
    return tokenizer.model_file


def encode_line(tokenizer: Tokenizer, text: str) -> list[int]:
    """One line of a document as prepared data holds it (see the module docstring)."""
    if tokenizer_kind(tokenizer) == WORD:
        return tokenizer.encode(text, add_eos=True)
    return tokenizer.encode(text, add_special_tokens=False)


def document_end_id(tokenizer: Tokenizer) -> int:
    """The id after each document: ``<eod>`` (sentencepiece) or ``<eos>`` (word-level)."""
    if tokenizer_kind(tokenizer) == WORD:
        if tokenizer.eos_id is None:
            raise ValueError(f"the vocabulary has no {tokenizer.eos_token!r} symbol to end lines and documents with")
        return tokenizer.eos_id
    return EOD_ID


def worker_spec(tokenizer: Tokenizer) -> tuple:
    """What rebuilds the tokenizer in a worker process (``from_worker_spec``)."""
    if tokenizer_kind(tokenizer) == WORD:
        options = {k: v for k, v in tokenizer_options(tokenizer).items()}
        return WORD, (tokenizer.idx2sym,), {**options, "special": tokenizer.special}
    return SENTENCEPIECE, (tokenizer.model_file,), tokenizer_options(tokenizer)


def from_worker_spec(spec: tuple) -> Tokenizer:
    kind, args, options = spec
    return (TransfoXLTokenizer if kind == WORD else XLNetTokenizer)(*args, **options)
