"""A complete PyTorch XLNet with transformers' parameter names, forward arguments and outputs.

``layers`` (the layer, read top to bottom), ``backbone`` (``XLNetModel``), ``heads`` (the task
models), ``outputs``, ``inputs`` (defaults and validation of the forward's arguments), ``pretrained``
(init, loading and saving transformers' format). Every attention call goes through
``xlnet_fast.rel_attention`` with masks from ``xlnet_fast.masks``.
"""

from .backbone import XLNetModel
from .heads import (MODEL_CLASSES, XLNetForMultipleChoice, XLNetForQuestionAnswering,
                    XLNetForQuestionAnsweringSimple, XLNetForSequenceClassification, XLNetForTokenClassification,
                    XLNetLMHeadModel)
from .outputs import ModelOutput, XLNetLMHeadModelOutput, XLNetModelOutput
from .pretrained import XLNetPreTrainedModel

__all__ = ["XLNetModel", "XLNetPreTrainedModel", "XLNetLMHeadModel", "XLNetForSequenceClassification",
           "XLNetForTokenClassification", "XLNetForMultipleChoice", "XLNetForQuestionAnsweringSimple",
           "XLNetForQuestionAnswering", "MODEL_CLASSES", "ModelOutput", "XLNetModelOutput", "XLNetLMHeadModelOutput"]
