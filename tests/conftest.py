import os
import sys

import pytest
import torch

# The shared cases and references are the package tests/helpers (test modules never import each
# other); pytest runs with --import-mode=importlib, which adds nothing to sys.path, so put tests/ there.
sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run in Triton's CPU interpreter; it must be chosen before any
# kernel is decorated, i.e. before xlnet_fast.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text corpus for pretraining runs (modules may define their own)."""
    from helpers.pretraining import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus") / "text.txt")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache directory (tokenizers, token shards) shared by one module's runs, keyed by content."""
    return str(tmp_path_factory.mktemp("cache"))
