"""xlnet_fast: fast XLNet with fused relative attention."""

from .config import XLNetConfig
from .modeling import (
    XLNetForMultipleChoice,
    XLNetForQuestionAnswering,
    XLNetForQuestionAnsweringSimple,
    XLNetForSequenceClassification,
    XLNetForTokenClassification,
    XLNetLMHeadModel,
    XLNetModel,
    XLNetPreTrainedModel,
)
from .ops import INT32_MAX, INT32_MIN, attention_probabilities, rel_attention

__version__ = "0.1.0"

__all__ = [
    "rel_attention",
    "attention_probabilities",
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
    "__version__",
]
