"""Run the benchmarks and tests from a source checkout that is not pip-installed (a GPU machine that
gets a copy of the repository and has no network).

The package maps the top-level ``kernels/`` folder to ``xlnet_fast.kernels`` only when installed
(pyproject's ``package-dir``). ``ensure_kernels_importable()`` adds an import hook that finds
``xlnet_fast.kernels`` in ``<repo>/kernels`` when nothing else does; the module is imported lazily,
at its first import, so the choice of Triton's interpreter (``TRITON_INTERPRET``) is unaffected.
As a pytest plugin (``python -m pytest -p bench.source_tree ...``) it does the same before the tests
are collected.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"
KERNELS_MODULE = "xlnet_fast.kernels"


class _KernelsFinder(importlib.abc.MetaPathFinder):
    """Finds ``xlnet_fast.kernels`` in ``KERNELS_DIR``; consulted after the regular finders."""

    def find_spec(self, name, path=None, target=None):
        if name != KERNELS_MODULE:
            return None
        return importlib.util.spec_from_file_location(name, KERNELS_DIR / "__init__.py",
                                                      submodule_search_locations=[str(KERNELS_DIR)])


def ensure_kernels_importable() -> str | None:
    """Make ``import xlnet_fast.kernels`` work; returns a sentence saying what was done, or None when
    it already worked (installed package, or the ``xlnet_fast/kernels`` link of a worktree)."""
    note = f"{KERNELS_MODULE} is not installed: importing it from {KERNELS_DIR}"
    if any(isinstance(f, _KernelsFinder) for f in sys.meta_path):
        return note
    if KERNELS_MODULE in sys.modules:
        return None
    importlib.import_module("xlnet_fast")  # the parent package must be importable on its own
    if importlib.util.find_spec(KERNELS_MODULE) is not None:
        return None
    if not (KERNELS_DIR / "__init__.py").exists():
        raise ImportError(f"{KERNELS_MODULE} is not installed and {KERNELS_DIR} does not exist")
    sys.meta_path.append(_KernelsFinder())
    return note


def pytest_configure(config):  # noqa: ARG001 - pytest's hook signature
    ensure_kernels_importable()
