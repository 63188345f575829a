"""The repository's benchmarks and the records they write (not part of the installed package).

Run from a checkout, ``python -m bench.X`` puts the checkout first on ``sys.path``, so its
``xlnet_fast/`` is imported, and that folder has no ``kernels`` (pyproject maps the top-level
``kernels/`` to ``xlnet_fast.kernels`` only when installed). Every benchmark and the programs they
start (the campaign's steps, the program ncu profiles) therefore make ``xlnet_fast.kernels``
importable here, once, at the first import of ``bench``: a no-op when it already is.
"""

from bench.source_tree import ensure_kernels_importable

ensure_kernels_importable()
