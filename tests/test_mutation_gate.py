"""The mutation gate's machinery (``tests/mutation_gate.py``; the gate itself takes minutes and runs
outside CI, README "Tests"): every mutation's snippet is still in the source exactly once and every
test it selects still exists, so a refactor that moves the code fails here instead of leaving the gate
to fail later; a mutation changes a copy, never the checkout, and the copy imports its own sources; a
snippet that is gone fails the gate before any test runs."""

import ast
import io

import mutation_gate as gate


def test_every_snippet_is_in_the_source_once():
    assert gate.snippet_problems() == []


def test_every_selected_test_is_defined():
    for m in gate.MUTATIONS:
        assert m.tests, m.name
        for test in m.tests:
            file, _, rest = test.partition("::")
            path = gate.ROOT / file
            assert path.is_file(), (m.name, test)
            if rest:
                defined = {node.name for node in ast.walk(ast.parse(path.read_text()))
                           if isinstance(node, ast.FunctionDef)}
                assert rest.split("[")[0] in defined, (m.name, test)


def test_mutations_are_named_once_and_cover_the_issues_list():
    names = [m.name for m in gate.MUTATIONS]
    assert len(names) == len(set(names))
    assert {"clamp_removed", "bi_data_sign", "distance_shift", "positions_zeroed", "memory_segment", "biases_swapped",
            "seg_embed_index", "self_visible_dropped", "triton_shift_transposed", "triton_backward_lse",
            "patch_falls_back_on_mems"} <= set(names)


def test_a_mutation_changes_a_copy_that_imports_its_own_sources(tmp_path):
    m = gate.MUTATIONS[0]
    before = (gate.ROOT / m.file).read_text()
    tree = gate.copy_checkout(tmp_path / "copy")
    gate.apply(m, tree)
    mutated = (tree / m.file).read_text()
    assert mutated == before.replace(m.old, m.new) and mutated != before
    assert (gate.ROOT / m.file).read_text() == before
    gate.check_imports(tree)  # raises when pytest there would import another xlnet_fast


def test_a_snippet_no_longer_in_the_source_fails_the_gate():
    moved = gate.Mutation("moved", "xlnet_fast/masks.py", "a line a refactor removed", "x", ("tests/test_masks.py",),
                          "a stale mutation")
    out = io.StringIO()
    assert gate.run_gate((moved,), out=out) == 1
    assert "occurs 0 times in xlnet_fast/masks.py" in out.getvalue() and "baseline" not in out.getvalue()
