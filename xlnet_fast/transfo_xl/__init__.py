"""Transformer-XL on xlnet_fast's attention op: the model transformers 5 deleted, loading and saving
transformers 4.x's ``transfo-xl`` directories.

``config`` (``TransfoXLConfig``), ``adaptive`` (adaptive input and softmax), ``model``
(``TransfoXLModel``, ``TransfoXLLMHeadModel``), ``tokenizer`` (the word-level vocabulary, read
without unpickling objects), ``evaluate`` (perplexity over a token stream with memory, as the
original ``eval.py``).
"""

from .config import TransfoXLConfig
from .model import (TransfoXLLMHeadModel, TransfoXLLMHeadModelOutput, TransfoXLModel, TransfoXLModelOutput,
                    TransfoXLPreTrainedModel, is_transfo_xl_dir)
from .tokenizer import TransfoXLTokenizer

__all__ = ["TransfoXLConfig", "TransfoXLModel", "TransfoXLLMHeadModel", "TransfoXLPreTrainedModel",
           "TransfoXLModelOutput", "TransfoXLLMHeadModelOutput", "TransfoXLTokenizer", "is_transfo_xl_dir"]
