import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The shared cases and references are the package tests/helpers (test modules never import each
# other); pytest runs with --import-mode=importlib, which adds nothing to sys.path, so put tests/ there.
sys.path.insert(0, os.path.dirname(__file__))


def _import_bench_from_the_checkout() -> None:
    """``bench`` (the repository's scripts, not part of the package) from this checkout, without
    putting the checkout on sys.path: there its ``xlnet_fast/`` would shadow an installed package."""
    spec = importlib.util.find_spec("bench")
    if spec is not None or not os.path.isfile(os.path.join(ROOT, "bench", "__init__.py")):
        return  # importable already (run from the checkout), or no bench/ here
    spec = importlib.util.spec_from_file_location("bench", os.path.join(ROOT, "bench", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(ROOT, "bench")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module
    spec.loader.exec_module(module)


def _check_the_package_is_the_installed_one() -> None:
    """With ``XLNET_FAST_TEST_INSTALLED=1`` (CI against the built wheel) every test must import the
    installed xlnet_fast, never this checkout's sources. The variable is not passed on to the tests'
    subprocesses: bench.campaign, for one, runs the suite from the source tree on purpose."""
    if os.environ.pop("XLNET_FAST_TEST_INSTALLED", None) != "1":
        return
    for name in ("xlnet_fast", "xlnet_fast.kernels"):
        origin = importlib.util.find_spec(name).origin
        if os.path.realpath(origin).startswith(ROOT + os.sep):
            raise pytest.UsageError(f"XLNET_FAST_TEST_INSTALLED=1 but {name} comes from the checkout ({origin}): run "
                                    "pytest from outside it with the package installed")


# Without a GPU the Triton kernels run in Triton's CPU interpreter; it must be chosen before any
# kernel is decorated, i.e. before xlnet_fast.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_import_bench_from_the_checkout()
_check_the_package_is_the_installed_one()  # imports xlnet_fast (after TRITON_INTERPRET is set)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text corpus for pretraining runs (modules may define their own)."""
    from helpers.pretraining import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus") / "text.txt")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache directory (tokenizers, token shards) shared by one module's runs, keyed by content."""
    return str(tmp_path_factory.mktemp("cache"))
