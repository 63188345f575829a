"""The kernels import nothing above them: ``kernels/`` (installed as ``xlnet_fast.kernels``) reads what
it shares with the package from ``kernels/contract.py``, a leaf of the standard library only, and
``xlnet_fast`` reads the same module (one definition of every value).

Read from the sources (``ast``), not by importing them."""

import ast
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
PROJECT_PACKAGES = {"xlnet_fast", "kernels", "bench", "helpers"}  # importable from a checkout or an install


def _imports(path: Path):
    """(top-level name or None for a relative import, level) of every import statement in ``path``."""
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name.split(".")[0], 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield (node.module.split(".")[0] if node.level == 0 else None), node.level


def test_the_kernels_import_nothing_above_them():
    wrong = []
    for path in sorted(KERNELS.rglob("*.py")):
        depth = len(path.relative_to(KERNELS).parts)  # kernels/x.py: 1, the deepest relative import it may make
        for name, level in _imports(path):
            if name in PROJECT_PACKAGES or level > depth:
                wrong.append(f"{path.relative_to(KERNELS.parent)}: {name or '.' * level}")
    assert not wrong, "kernels/ must import only within itself (shared values: kernels/contract.py)"


def test_the_contract_imports_only_the_standard_library():
    imported = list(_imports(KERNELS / "contract.py"))
    assert imported and all(name in sys.stdlib_module_names for name, _ in imported), imported


def test_the_package_and_the_kernels_share_one_contract():
    from xlnet_fast import masks
    from xlnet_fast.kernels import contract, rel_attention

    assert contract is sys.modules["xlnet_fast.kernels.contract"] is rel_attention.contract
    assert masks.INT32_MIN is contract.INT32_MIN and masks.INT32_MAX is contract.INT32_MAX
    assert rel_attention.ROW_FIELDS.value == contract.ROW_FIELDS  # the constexprs wrap the same values
