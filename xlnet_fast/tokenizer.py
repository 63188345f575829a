"""XLNet tokenizer over sentencepiece, with XLNet's conventions.

Ids ``<unk>0 <s>1 </s>2 <cls>3 <sep>4 <pad>5 <mask>6 <eod>7 <eop>8``; a pair is laid out
``A <sep> B <sep> <cls>`` with segment ids 0 (A and its <sep>), 1 (B and its <sep>), 2 (<cls>);
batches are padded on the left (padding gets token type 3, as in ``transformers``).
"""

from __future__ import annotations

import io
import os
import shutil
import unicodedata
from collections.abc import Iterable, Sequence

import torch

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<cls>", "<sep>", "<pad>", "<mask>", "<eod>", "<eop>"]
UNK_ID, BOS_ID, EOS_ID, CLS_ID, SEP_ID, PAD_ID, MASK_ID, EOD_ID, EOP_ID = range(9)
SEG_A, SEG_B, SEG_CLS, SEG_PAD = 0, 1, 2, 3
SPIECE_NAME = "spiece.model"
_UNDERLINE = "\u2581"


class XLNetTokenizer:
    """Sentencepiece tokenizer with XLNet's special ids, layout and left padding."""

    padding_side = "left"

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
        """Load ``spiece.model`` from a directory (or a path to the model file itself)."""
        path = os.fspath(directory)
        if os.path.isdir(path):
            path = os.path.join(path, SPIECE_NAME)
        return cls(path, **kwargs)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        os.makedirs(directory, exist_ok=True)
        target = os.path.join(directory, SPIECE_NAME)
        if os.path.abspath(target) != os.path.abspath(self.model_file):
            shutil.copyfile(self.model_file, target)

    # ---------------------------------------------------------------- basic properties
    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    def __len__(self) -> int:
        return self.vocab_size

    pad_token_id, cls_token_id, sep_token_id, mask_token_id = PAD_ID, CLS_ID, SEP_ID, MASK_ID
    unk_token_id, bos_token_id, eos_token_id = UNK_ID, BOS_ID, EOS_ID

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
        """Pieces, with the original's split of a digit run followed by a comma ("9," -> "9", ",")."""
        pieces = self.sp.EncodeAsPieces(self.preprocess_text(text))
        out: list[str] = []
        for piece in pieces:
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

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int]:
        return [self.sp.PieceToId(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.sp.IdToPiece(int(i)) for i in ids]

    def encode(self, text: str, text_pair: str | None = None, add_special_tokens: bool = True,
               max_length: int | None = None, truncation: bool = False) -> list[int]:
        return self._encode_one(text, text_pair, add_special_tokens, max_length, truncation)[0]

    def _encode_one(self, text, text_pair, add_special_tokens, max_length, truncation):
        if not isinstance(text, str) or (text_pair is not None and not isinstance(text_pair, str)):
            raise TypeError("text and text_pair must be str")
        a = self.convert_tokens_to_ids(self.tokenize(text))
        b = self.convert_tokens_to_ids(self.tokenize(text_pair)) if text_pair is not None else None
        if truncation and max_length is not None:
            n_special = (3 if b is not None else 2) if add_special_tokens else 0
            budget = max_length - n_special
            if budget < 0:
                raise ValueError(f"max_length={max_length} leaves no room for the special tokens")
            while len(a) + (len(b) if b is not None else 0) > budget:  # longest first, like HF
                if b is not None and len(b) > len(a):
                    b.pop()
                else:
                    a.pop()
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

    def __call__(self, text: str | Sequence[str], text_pair: str | Sequence[str] | None = None, *,
                 padding: bool | str = True, truncation: bool = False, max_length: int | None = None,
                 add_special_tokens: bool = True, return_tensors: str | None = "pt") -> dict:
        """Encode one text or a batch. Returns ``input_ids``, ``token_type_ids``, ``attention_mask``
        (tensors of shape ``(B, L)``, left-padded, when ``return_tensors="pt"``; lists otherwise)."""
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        if text_pair is None:
            pairs: list = [None] * len(texts)
        else:
            pairs = [text_pair] if isinstance(text_pair, str) else list(text_pair)
            if len(pairs) != len(texts):
                raise ValueError(f"text_pair has {len(pairs)} entries, text has {len(texts)}")
        if max_length is not None and max_length <= 0:
            raise ValueError(f"max_length must be positive, got {max_length}")
        enc = [self._encode_one(t, p, add_special_tokens, max_length, truncation)
               for t, p in zip(texts, pairs)]
        if padding is True or padding == "longest":
            target = max(len(ids) for ids, _ in enc) if enc else 0
        elif padding == "max_length":
            if max_length is None:
                raise ValueError("padding='max_length' needs max_length")
            target = max_length
        elif padding in (False, "do_not_pad"):
            target = None
        else:
            raise ValueError(f"padding must be True, False, 'longest' or 'max_length', got {padding!r}")
        out = {"input_ids": [], "token_type_ids": [], "attention_mask": []}
        for ids, types in enc:
            n_pad = max(0, target - len(ids)) if target is not None else 0
            out["input_ids"].append([PAD_ID] * n_pad + ids)
            out["token_type_ids"].append([SEG_PAD] * n_pad + types)
            out["attention_mask"].append([0] * n_pad + [1] * len(ids))
        if return_tensors == "pt":
            lengths = {len(r) for r in out["input_ids"]}
            if len(lengths) > 1:
                raise ValueError("sequences have different lengths; pass padding=True to batch them")
            return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}
        if return_tensors is not None:
            raise ValueError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        if single:
            return {k: v[0] for k, v in out.items()}
        return out

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i >= len(SPECIAL_TOKENS)]
        return self.sp.DecodeIds(ids)

    def batch_decode(self, batch, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]


def train_tokenizer(files_or_texts: str | os.PathLike | Iterable[str], vocab_size: int,
                    out_dir: str | os.PathLike, *, character_coverage: float = 0.9995,
                    max_sentences: int = 2_000_000, **tokenizer_kwargs) -> XLNetTokenizer:
    """Train a unigram sentencepiece model with XLNet's special ids; writes ``out_dir/spiece.model``.

    ``files_or_texts``: a path, a list of paths, or an iterable of text lines.
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
    os.makedirs(out_dir, exist_ok=True)
    model = io.BytesIO()
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
    path = os.path.join(out_dir, SPIECE_NAME)
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return XLNetTokenizer(path, **tokenizer_kwargs)
