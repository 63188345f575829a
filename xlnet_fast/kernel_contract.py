"""``contract``: the module ``xlnet_fast.kernels.contract`` (``kernels/contract.py``), for the code
that must not import the kernels.

The usual import would run ``xlnet_fast.kernels`` first, which imports triton and decorates the
kernels, and Triton fixes at decoration whether they are interpreted (``TRITON_INTERPRET``):
importing ``xlnet_fast`` must leave that to the first kernel call. Nor can ``xlnet_fast`` rely on
finding ``xlnet_fast.kernels`` at all: a source checkout that is not installed maps ``kernels/``
there only later (``bench.source_tree``). The contract imports nothing but the standard library, so
it is loaded from its file alone and registered under its own name: the kernels' ``from . import
contract`` then finds this very module (one definition of every value), and so does an import of
``xlnet_fast.kernels.contract``, without importing ``xlnet_fast.kernels``.
"""

import importlib.util
import sys
from pathlib import Path

NAME = "xlnet_fast.kernels.contract"


def _load():
    kernels = importlib.util.find_spec("xlnet_fast.kernels")
    # not findable: a source checkout without the xlnet_fast/kernels link; kernels/ is beside xlnet_fast/
    folder = Path(kernels.submodule_search_locations[0]) if kernels else Path(__file__).parents[1] / "kernels"
    spec = importlib.util.spec_from_file_location(NAME, folder / "contract.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    spec.loader.exec_module(module)
    return module


contract = sys.modules.get(NAME) or _load()
