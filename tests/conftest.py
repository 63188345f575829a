import os
import sys

import torch

# Helpers (the float64 reference, HF adapters) live beside the tests; pytest runs with
# --import-mode=importlib, so put this folder on sys.path for them.
sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run in Triton's CPU interpreter; it must be chosen before any
# kernel is decorated, i.e. before xlnet_fast.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
