"""The package list, found by discovery (the metadata is in pyproject.toml).

Every package under ``xlnet_fast/`` ships, so a new subpackage cannot be left out. The Triton kernels
live in the top-level folder ``kernels/`` and ship as ``xlnet_fast.kernels`` (with any subpackage of
``kernels/``): a top-level ``kernels`` module must never be installed, it would shadow the unrelated
``kernels`` package that transformers probes for. ``bench/`` and ``tests/`` are the repository's, not
the package's. Files besides modules inside those folders ship too (MANIFEST.in grafts them).
"""

from setuptools import find_packages, setup

KERNELS_DIR, KERNELS_PACKAGE = "kernels", "xlnet_fast.kernels"

# xlnet_fast/kernels may be a symlink to kernels/ in a developer's tree: it is mapped below instead
packages = find_packages(include=["xlnet_fast", "xlnet_fast.*"], exclude=[KERNELS_PACKAGE, KERNELS_PACKAGE + ".*"])
packages += [KERNELS_PACKAGE] + [f"{KERNELS_PACKAGE}.{name}" for name in find_packages(KERNELS_DIR)]

setup(packages=packages, package_dir={"xlnet_fast": "xlnet_fast", KERNELS_PACKAGE: KERNELS_DIR},
      include_package_data=True)
