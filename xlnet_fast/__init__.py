"""xlnet_fast: fast XLNet (and Transformer-XL) with fused relative attention."""

from .config import XLNetConfig
from .model import (
    XLNetForMultipleChoice,
    XLNetForQuestionAnswering,
    XLNetForQuestionAnsweringSimple,
    XLNetForSequenceClassification,
    XLNetForTokenClassification,
    XLNetLMHeadModel,
    XLNetModel,
    XLNetPreTrainedModel,
)
from .hf_patch import from_hf, patch_transformers, to_hf, unpatch_transformers
from .masks import local_perm
from .attention import (attention_probabilities, prepare_masks, prepare_two_stream_masks, rel_attention,
                        rel_attention_two_stream)
from .masks import INT32_MAX, INT32_MIN
from .pretrain.tokenizer import XLNetTokenizer, train_tokenizer
from .transfo_xl import TransfoXLConfig, TransfoXLLMHeadModel, TransfoXLModel
from .transfo_xl.tokenizer import TransfoXLTokenizer

__version__ = "0.1.0"

__all__ = [
    "rel_attention",
    "rel_attention_two_stream",
    "attention_probabilities",
    "prepare_masks",
    "prepare_two_stream_masks",
    "INT32_MIN",
    "INT32_MAX",
    "XLNetConfig",
    "XLNetModel",
    "XLNetPreTrainedModel",
    "XLNetLMHeadModel",
    "XLNetForSequenceClassification",
    "XLNetForTokenClassification",
    "XLNetForMultipleChoice",
    "XLNetForQuestionAnsweringSimple",
    "XLNetForQuestionAnswering",
    "XLNetTokenizer",
    "train_tokenizer",
    "local_perm",
    "patch_transformers",
    "unpatch_transformers",
    "from_hf",
    "to_hf",
    "TransfoXLConfig",
    "TransfoXLModel",
    "TransfoXLLMHeadModel",
    "TransfoXLTokenizer",
    "__version__",
]
