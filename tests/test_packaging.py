"""What users install: the wheel built from this tree holds every package of the source (found by
discovery, so a new subpackage cannot be left out), ``kernels/`` as ``xlnet_fast.kernels`` and never
as a top-level ``kernels``, no ``bench``/``tests``; unpacked outside the checkout it imports and its
command line starts."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = {"xlnet_fast": "xlnet_fast", "kernels": "xlnet_fast/kernels"}  # folder -> where it installs


def _copy_tree(dst: Path) -> None:
    """The files a build reads (not the developer's xlnet_fast/kernels symlink, caches or build output)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, dst / name)
    for folder in ("xlnet_fast", "kernels", "bench", "tests"):
        shutil.copytree(ROOT / folder, dst / folder, ignore=ignore, symlinks=True)
    link = dst / "xlnet_fast" / "kernels"
    if link.is_symlink():
        link.unlink()


def _source_files(tree: Path) -> set[str]:
    """Every file of the package's folders, as installed (``kernels/x.py`` -> ``xlnet_fast/kernels/x.py``)."""
    files = set()
    for folder, installed in SOURCE_FOLDERS.items():
        for path in (tree / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                files.add(f"{installed}/{path.relative_to(tree / folder).as_posix()}")
    return files


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A copy of the tree with a new subpackage (and a data file) in both folders, and its wheel's path."""
    pytest.importorskip("setuptools")
    tree = tmp_path_factory.mktemp("tree")
    _copy_tree(tree)
    for new in (tree / "xlnet_fast" / "added" / "deeper", tree / "kernels" / "added"):
        new.mkdir(parents=True)
        (new / "__init__.py").write_text("VALUE = 1\n")
    (tree / "xlnet_fast" / "added" / "table.json").write_text("{}\n")
    wheels = tmp_path_factory.mktemp("wheels")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(wheels), str(tree)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = wheels.glob("xlnet_fast-*.whl")
    return tree, wheel


def test_the_wheel_holds_every_package_file_and_nothing_else(built):
    tree, wheel = built
    names = set(zipfile.ZipFile(wheel).namelist())
    package_files = {n for n in names if ".dist-info/" not in n}
    assert package_files == _source_files(tree)
    assert {"xlnet_fast/added/deeper/__init__.py", "xlnet_fast/kernels/added/__init__.py",
            "xlnet_fast/added/table.json"} <= package_files  # new subpackages and data are found
    assert {n.split("/")[0] for n in package_files} == {"xlnet_fast"}  # no top-level kernels, bench, tests
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "xlnet-fast = xlnet_fast.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_unpacked_wheel_imports_and_starts_outside_the_checkout(built, tmp_path):
    _, wheel = built
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import xlnet_fast, xlnet_fast.kernels, xlnet_fast.model, xlnet_fast.pretrain.loop, xlnet_fast.attention\n"
            "from xlnet_fast.cli import main\n"
            "print(xlnet_fast.__file__); print(xlnet_fast.kernels.__file__)\n"
            "raise SystemExit(main(['--version']))\n")
    # the unpacked wheel first on the path, the working directory outside the checkout
    env = dict(os.environ, PYTHONPATH=str(site))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    package, kernels, version = res.stdout.strip().splitlines()
    assert Path(package).is_relative_to(site) and Path(kernels).is_relative_to(site)
    assert version.startswith("xlnet-fast ")
