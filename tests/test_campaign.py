"""bench.campaign, the GPU campaign in one command. One CPU dry run of the whole campaign (tiny
shapes, the kernels in Triton's interpreter): the files it writes, the record schema, what each step
measures. The failure handling with stand-in step processes (one fails, one dies, one hangs with the
process group it started), the time-box, the refusals; and the pieces that only run on a GPU, fed
with what a GPU gives (pytest's output, autotuner caches, GPU-like records for the summary and the
README tables)."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import campaign, campaign_report
from bench.compiler import pinned_configs

ROOT = Path(__file__).resolve().parents[1]
COMMON_FIELDS = {"run", "step", "op", "status", "t", "device"}
STATUSES = {"ok", "error", "skipped", "cut", "oom"}
ALL_FILES = {"campaign.jsonl", "campaign.log", "summary.md", "attention.png", "model_step.png"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_schema(records):
    assert records
    run_ids = {r["run"] for r in records}
    assert len(run_ids) == 1
    times = [r["t"] for r in records]
    assert times == sorted(times)
    for r in records:
        assert COMMON_FIELDS <= set(r), r
        assert r["status"] in STATUSES, r
        if r["status"] == "error":
            assert r["error"], r
        if r["status"] in ("skipped", "cut"):
            assert r["reason"], r


def by(records, **match):
    return [r for r in records if all(r.get(k) == v for k, v in match.items())]


def test_dry_run_writes_its_files_and_measures_every_step(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # The dry run takes ~85 s alone. The budget only caps each step's share, so a generous one costs no time,
    # while 3 min gave the env step 4.9 s and CI's loaded workers (pytest -n auto) then cut it.
    proc = subprocess.run([sys.executable, "-m", "bench.campaign", "--cpu-dry-run", "--out", str(out), "--budget-min",
                           "12", "--sweep-D", "8"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == ALL_FILES  # no temporary file left
    records = [json.loads(line) for line in (out / campaign.RECORDS_FILE).read_text().splitlines()]
    assert_schema(records)
    steps = by(records, op="step")
    assert [(s["step"], s["status"]) for s in steps] == [(s, "ok") for s in campaign.STEPS]
    # compile: without CUDA the binaries the sweep's calls make on sm_90 are counted, not compiled
    [ahead] = by(records, op="precompile")
    assert ahead["status"] == "skipped" and ahead["arch"] == 90 and ahead["binaries"] > 0
    # correctness: the test suite in a subprocess, the float64 check
    [tests] = by(records, op="pytest")
    assert tests["status"] == "ok" and tests["counts"]["passed"] == 1 and tests["returncode"] == 0
    # each test named with its outcome, relative to the repository, and the per-test timeout it ran under
    [(name, outcome)] = tests["tests"].items()
    assert name.startswith("tests/test_triton_kernels.py::test_head_dims_past_the_kernels_limit")
    assert outcome == "passed"
    assert tests["failed_tests"] == [] and 0 < tests["per_test_timeout_s"] <= campaign.PER_TEST_TIMEOUT_S
    [check] = by(records, op="xlnet_attn_check", status="ok")
    assert check["within_tolerance"] and check["deterministic"] and 0 < check["rel_err_out"] < 1e-2
    [each_config] = by(records, op="xlnet_attn_check", status="skipped")  # no autotuner in the interpreter
    assert each_config["config"] == "each" and "fixed tiles" in each_config["reason"]
    # the sweep: every provider on the same shape
    [agree] = by(records, op="provider_agreement")
    assert set(agree["rel_err_vs_eager_fp32"]) == {"xlnet_fast", "xlnet_fast_prepared", "xlnet_fast_pointers",
                                                   "xlnet_fast_addresses", "hf", "flex"}
    assert max(agree["rel_err_vs_eager_fp32"].values()) < 1e-5
    timed = by(records, op="xlnet_attn", status="ok")
    assert {(r["provider"], r["mode"]) for r in timed if not r.get("repeat")} == {
        ("xlnet_fast", "fwd"), ("xlnet_fast", "fwd_bwd"), ("xlnet_fast_prepared", "fwd"),
        ("xlnet_fast_prepared", "fwd_bwd"), ("xlnet_fast_pointers", "fwd"), ("xlnet_fast_pointers", "fwd_bwd"),
        ("xlnet_fast_addresses", "fwd"), ("xlnet_fast_addresses", "fwd_bwd"), ("xlnet_fast_det", "fwd_bwd"), ("eager", "fwd"),
        ("eager", "fwd_bwd"), ("hf", "fwd"), ("hf", "fwd_bwd"), ("flex", "fwd"), ("fa2_ref", "fwd"),
        ("fa2_ref", "fwd_bwd")}
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["D"] == 8 for r in timed)  # --sweep-D 8
    assert len(by(records, op="xlnet_attn", provider="xlnet_fast", repeat=True)) == 1
    skipped = by(records, op="xlnet_attn", status="skipped")
    assert {(r["provider"], r["mode"]) for r in skipped} == {("sdpa_flash", "fwd"), ("sdpa_flash", "fwd_bwd"),
                                                             ("flex", "fwd_bwd")}
    assert all(r["reason"].startswith(campaign.NEEDS_CUDA) for r in skipped)
    # the model's training step and inference forward (bench.model_step)
    steps_measured = by(records, op="model_step", status="ok")
    assert sorted((r["provider"], r["mode"]) for r in steps_measured) == sorted(
        (p, m) for p in ("hf", "patched", "native") for m in ("train", "infer"))
    assert all(r["tokens_per_s"] > 0 for r in steps_measured)
    # memory: Transformer-XL evaluation with memory vs recompute, generation with memory vs recompute
    reuse = by(records, op="memory_reuse", status="ok")
    assert [r["attention_length"] for r in reuse] == [16, 32] and all(r["speedup"] > 0 for r in reuse)
    gen = by(records, op="generation", status="ok")
    assert sorted(r["model"] for r in gen) == ["transfo-xl", "xlnet"]
    assert [r["same_tokens"] for r in gen if r["model"] == "transfo-xl"] == [True]
    # ncu: no CUDA and no Nsight Compute here; the profiled program ran (one warm-up and one call per
    # provider) and the record holds the command a GPU would run
    runs = by(records, op="ncu_run")
    assert [(r["run_name"], r["status"]) for r in runs] == [(name, "skipped") for name, _, _ in
                                                           campaign.PLANS["dry"].ncu_runs]
    for r in runs:
        assert r["reason"].startswith("needs CUDA and Nsight Compute")
        assert [line.split()[-3] for line in r["program_lines"]] == r["providers"]  # "... PROVIDER profiled once"
        for needed in (*campaign.NCU_METRICS[:2], "WarpStateStats", "--clock-control none", "--profile-from-start off",
                       "--ncu"):
            assert needed in r["command"]
    for name in ("attention.png", "model_step.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    # the summary printed last is the one written
    summary = (out / "summary.md").read_text()
    assert proc.stdout.strip().endswith(summary.strip())
    assert "needs CUDA (the flash backend)" in summary
    assert "## Memory: evaluation and generation" in summary and "| tiny float32 | 32 | 8 | 24 |" in summary


def test_a_failing_a_dying_and_a_hanging_step_are_recorded_and_the_next_steps_run(tmp_path, monkeypatch, capsys):
    """Stand-ins for the steps' processes: one reports an error, one dies without a word (as on a
    fatal CUDA error), one is still running past its share with a process group it started (as the
    correctness step starts the test suite): killed with that group, a cut recorded. Then the budget
    is used up: the next step is not started, and the summary is still written."""
    pid_file = tmp_path / "grandchild.pid"
    scripts = {
        "env": "print('@record {\"op\": \"environment\", \"status\": \"error\", \"error\": \"RuntimeError: no\"}')\n"
               "import sys; sys.exit(1)\n",
        "correctness": "import os; os._exit(70)\n",
        "sweep": ("import pathlib, subprocess, sys, time\n"
                  "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
                  f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid))\n"
                  "print('@group', p.pid, flush=True)\n"
                  "print('@record {\"op\": \"x\", \"status\": \"ok\"}', flush=True)\n"
                  "time.sleep(120)\n")}
    monkeypatch.setattr(campaign.Campaign, "child_command",
                        lambda self, step, deadline: [sys.executable, "-c", scripts[step]])
    steps = ["env", "correctness", "sweep", "memory", "plots"]
    c = campaign.Campaign(tmp_path / "out", budget_s=1, mode="dry", steps=steps)
    t0 = time.time()
    for step in ("env", "correctness", "sweep"):
        c.run_step(step, share=campaign.MIN_STEP_S)
    assert time.time() - t0 < 3 * campaign.MIN_STEP_S + campaign.GRACE_MIN_S + 20
    c.run_step("memory", c.share("memory", ["memory", "plots"]))
    c.finish()
    assert_schema(c.records)
    assert [(r["step"], r["op"], r["status"]) for r in c.records] == [
        ("env", "environment", "error"), ("env", "step_process", "error"), ("env", "step", "error"),
        ("correctness", "step_process", "error"), ("correctness", "step", "error"),
        ("sweep", "x", "ok"), ("sweep", "step_killed", "cut"), ("sweep", "step", "cut"), ("memory", "step", "cut"),
        ("plots", "plot", "skipped"), ("plots", "plot", "skipped"), ("plots", "step", "ok")]  # nothing to plot
    assert "status 70" in c.records[3]["error"]
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    deadline = time.time() + 10
    while stat.exists() and stat.read_text().split()[2] != "Z" and time.time() < deadline:
        time.sleep(0.1)
    assert not stat.exists() or stat.read_text().split()[2] == "Z"  # killed (a zombie until reaped)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["campaign.jsonl", "campaign.log", "summary.md"]
    assert "cut: step memory not started" in capsys.readouterr().err
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "status 70" in summary and "error: env/environment" in summary and "RuntimeError: no" in summary
    assert "not started: the budget was used up" in summary


def test_a_program_a_step_runs_is_logged_and_killed_past_its_time(tmp_path, capsys):
    """``_run_logged`` (the correctness step's pytest, the ncu step's programs): every line logged,
    the program's process group killed after its time; ``_run_group`` turns that into a
    TimeoutError and a failing exit into a RuntimeError with its last lines."""
    r = campaign.Reporter(deadline=time.time() + 60, device="cpu")
    sleeper = [sys.executable, "-c", "print('started', flush=True); import time; time.sleep(60)"]
    begin = time.time()
    lines, returncode, stopped = campaign._run_logged(r, sleeper, tmp_path, dict(os.environ), 2.0)
    assert stopped and lines == ["started"] and returncode != 0 and time.time() - begin < 30
    with pytest.raises(TimeoutError, match="stopped after 1 s"):
        campaign._run_group(r, sleeper, dict(os.environ), 1.0)
    failing = [sys.executable, "-c", "print('why'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match=r"exit status 3: why"):
        campaign._run_group(r, failing, dict(os.environ), 30.0)
    assert campaign._run_group(r, [sys.executable, "-c", "print('ok')"], dict(os.environ), 30.0) == ["ok"]


def test_items_past_the_deadline_are_cut_and_an_item_out_of_memory_or_raising_is_recorded(capsys):
    r = campaign.Reporter(deadline=time.time() - 1, device="cpu")
    assert list(r.each([1, 2, 3], lambda x: f"item{x}", "xlnet_attn")) == []
    r = campaign.Reporter(deadline=time.time() + 60, device="cpu")
    assert list(r.each([1, 2], str, "x")) == [1, 2]

    def too_big():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
    [oom] = r.attempt("pretrain_step", too_big, provider="hf")
    assert oom["status"] == "oom" and oom["provider"] == "hf"
    [ok] = r.attempt("x", lambda: {"ms": 1.0, "status": "ok"}, provider="p")
    assert ok["status"] == "ok" and ok["ms"] == 1.0
    [error] = r.attempt("x", lambda: 1 / 0, provider="p")
    assert error["status"] == "error" and error["error"] == "ZeroDivisionError: division by zero"
    out = capsys.readouterr().out
    cut = [json.loads(line[len(campaign.RECORD_PREFIX):]) for line in out.splitlines()
           if line.startswith(campaign.RECORD_PREFIX)][0]
    assert cut["status"] == "cut" and cut["not_run"] == ["item1", "item2", "item3"]
    assert "Traceback" in out and "ZeroDivisionError" in out


def test_refuses_a_folder_holding_another_runs_files_bad_arguments_and_no_gpu(tmp_path, capsys):
    (tmp_path / "campaign.jsonl").write_text("{}\n")
    assert campaign.main(["--out", str(tmp_path), "--cpu-dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "campaign.jsonl" in err
    assert (tmp_path / "campaign.jsonl").read_text() == "{}\n"
    assert campaign.main(["--cpu-dry-run"]) == 2 and "--out" in capsys.readouterr().err
    assert campaign.main(["--out", str(tmp_path / "x"), "--budget-min", "0", "--cpu-dry-run"]) == 2
    capsys.readouterr()
    if not torch.cuda.is_available():  # the CPU refusal
        assert campaign.main(["--out", str(tmp_path / "o"), "--quick"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no CUDA device" in err and "--cpu-dry-run" in err
        assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------------
# What only a GPU produces, fed in
# --------------------------------------------------------------------------------------------------


def test_pytest_output_is_counted_from_the_closing_line_or_the_test_lines():
    closing = ["tests/test_a.py::test_x PASSED                    [ 50%]",
               "FAILED tests/test_a.py::test_y - AssertionError: no",
               "ERROR tests/test_b.py::test_z - RuntimeError",
               f"FAILED tests/test_b.py::test_slow[a-1] - Failed: {pinned_configs.TIMEOUT_MARK}: ran past 9 s",
               "=== 2 failed, 10 passed, 2 skipped, 1 error in 3.21s ==="]
    got = campaign.parse_pytest(closing)
    assert got["counts"] == {"failed": 2, "passed": 10, "skipped": 2, "errors": 1}
    assert got["failed_tests"] == ["tests/test_a.py::test_y", "tests/test_b.py::test_slow[a-1]",
                                   "tests/test_b.py::test_z"]
    assert got["timed_out_tests"] == ["tests/test_b.py::test_slow[a-1]"]
    assert got["tests"] == {"tests/test_a.py::test_x": "passed"}
    # stopped before pytest's summary (the H200's second run: a failure under xdist, never named):
    # the -v lines name every test that finished, the failed ones among them
    stopped = ["[gw0] [ 10%] PASSED tests/test_a.py::test_x",
               "[gw1] [ 20%] FAILED ../../repo/tests/test_a.py::test_y[16-16]",
               "[gw0] [ 30%] SKIPPED tests/test_a.py::test_z", "[gw1] [ 40%] PASSED tests/test_a.py::test_w"]
    got = campaign.parse_pytest(stopped)
    assert got["closing_line"] is None and got["counts"] == {"passed": 2, "failed": 1, "skipped": 1}
    assert got["failed_tests"] == ["tests/test_a.py::test_y[16-16]"]
    assert got["tests"] == {"tests/test_a.py::test_w": "passed", "tests/test_a.py::test_x": "passed",
                            "tests/test_a.py::test_y[16-16]": "failed", "tests/test_a.py::test_z": "skipped"}


def test_a_test_past_its_timeout_fails_by_name_and_the_suite_goes_on(tmp_path):
    """The campaign's plugin (``-p bench.compiler.pinned_configs``) with ``$BENCH_TEST_TIMEOUT_S``:
    a hanging test fails with the timeout's mark, the next one still runs, and the record names both."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_hang.py").write_text(
        "import time\n\ndef test_hangs():\n    time.sleep(60)\n\ndef test_after():\n    assert True\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env[pinned_configs.TIMEOUT_ENV] = "1"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-p",
                           "bench.compiler.pinned_configs", "tests/test_hang.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert time.time() - t0 < 50, "the timeout did not stop the hanging test"
    got = campaign.parse_pytest(proc.stdout.splitlines())
    assert got["tests"] == {"tests/test_hang.py::test_after": "passed", "tests/test_hang.py::test_hangs": "failed"}
    assert got["timed_out_tests"] == ["tests/test_hang.py::test_hangs"] and got["counts"]["failed"] == 1


def test_failed_tests_run_again_alone_with_their_failure_text(tmp_path, capsys):
    """The correctness step re-runs the suite's failed tests alone (``rerun_failed``): a suite stopped
    at its share prints no failure text (the H100's first run lost two tests' reasons so); the record
    keeps pytest's FAILURES section and names what passes alone; the summary says both."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_f.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('n', [1])\ndef test_fails(n):\n    assert n == 2, 'boom'\n\n"
        "def test_ok():\n    assert True\n")
    r = campaign.Reporter(time.time() + 120, "cpu")
    got = campaign.rerun_failed(r, ["tests/test_f.py::test_fails[1]", "tests/test_f.py::test_ok"], 100, root=tmp_path)
    capsys.readouterr()  # the protocol lines
    assert got["status"] == "error" and got["failed_tests"] == ["tests/test_f.py::test_fails[1]"]
    assert got["passed_alone"] == ["tests/test_f.py::test_ok"]
    assert "FAILURES" in got["failure_text"] and "boom" in got["failure_text"]
    record = {"run": "r", "step": "correctness", "t": 1.0, "device": "x", "op": "pytest_rerun", **got}
    text = campaign_report.summary_markdown([record])
    assert ("- the failed tests alone (error): failed again: tests/test_f.py::test_fails[1]; passed alone: "
            "tests/test_f.py::test_ok (failure text in the record") in text


def test_ncu_csv_is_read_into_one_record_per_kernel():
    """``ncu --csv --page raw`` as it prints (a header, a units row, one row per kernel, the profiled
    program's own lines between): the bank conflicts, wavefronts and each stall reason per kernel."""
    header = ['"ID"', '"Process ID"', '"Kernel Name"', '"gpu__time_duration.sum"',
              '"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"',
              '"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"',
              '"smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio"',
              '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"', '"launch__registers_per_thread"',
              '"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"']
    lines = ["==PROF== Connected to process 1", "bf16 D=64 ... xlnet_fast     profiled once", ",".join(header),
             '"","","","usecond","","","","","register/thread",""',
             '"0","1","_fwd_kernel","878.75","1,234,567","89","3.50","0.25","228","2,469,134"',
             '"1","1","_fa2_fwd","206.59","0","0","0.40","0.60","125","1,000"', "==PROF== Disconnected from process 1"]
    fwd, ref = campaign.parse_ncu_csv(lines)
    assert fwd["kernel"] == "_fwd_kernel" and ref["kernel"] == "_fa2_fwd"
    assert fwd["metrics"]["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"] == [1234567.0, ""]
    assert fwd["metrics"]["gpu__time_duration.sum"] == [878.75, "usecond"]
    assert fwd["metrics"]["launch__registers_per_thread"] == [228.0, "register/thread"]
    assert list(fwd["stalls"].items()) == [("short_scoreboard", 3.5), ("barrier", 0.25)]
    assert list(ref["stalls"]) == ["barrier", "short_scoreboard"]  # the largest first
    assert campaign.parse_ncu_csv(["==PROF== nothing profiled"]) == []
    # and in the summary: the conflicts against the wavefronts, the largest stalls
    records = [{"run": "r", "step": "ncu", "t": 1.0, "device": "x", "op": "ncu_kernel", "status": "ok",
                "run_name": "pinned_64x64w4s1", **kernel} for kernel in (fwd, ref)]
    text = campaign_report.summary_markdown(records)
    assert "| pinned_64x64w4s1 | _fwd_kernel | 879 usecond | 228 | 1,234,567 / 2,469,134 | - |" in text
    assert "short_scoreboard 3.50, barrier 0.25" in text


def test_gpu_only_tests_are_named_in_the_record_with_their_outcome():
    lines = ["tests/test_a.py::test_x PASSED", "tests/test_a.py::test_graph_on_gpu[triton] PASSED [ 10%]",
             "[gw1] [ 20%] FAILED tests/test_b.py::test_bf16_on_gpu", "[gw0] [ 30%] SKIPPED tests/test_a.py::test_y",
             "FAILED tests/test_b.py::test_bf16_on_gpu - AssertionError: no",
             "=== 1 failed, 2 passed, 1 skipped in 3.21s ==="]
    got = campaign.parse_pytest(lines)
    assert got["gpu_only_tests"] == {"tests/test_a.py::test_graph_on_gpu[triton]": "passed",
                                     "tests/test_b.py::test_bf16_on_gpu": "failed"}


def _skipped_without_cuda(decorator) -> bool:
    """``@pytest.mark.skipif(not torch.cuda.is_available(), ...)``."""
    import ast

    return (isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.mark.skipif" and
            bool(decorator.args) and ast.unparse(decorator.args[0]) == "not torch.cuda.is_available()")


def test_every_gpu_only_test_is_named_on_gpu_and_run_by_the_campaign():
    """A test that only a GPU runs (skipped without CUDA) is named ``*_on_gpu``, so that the
    campaign's record names it with its outcome (``parse_pytest``), and is among the campaign's
    pytest targets: on a CPU it cannot fail, so the GPU campaign is where it means something."""
    import ast

    gpu_only = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(map(_skipped_without_cuda, node.decorator_list)):
                gpu_only.append((f"tests/{path.name}", node.name))
    assert len(gpu_only) >= 3  # determinism, CUDA graphs, bf16 convergence
    for file, name in gpu_only:
        assert "_on_gpu" in name, f"{file}::{name} runs only on a GPU: name it *_on_gpu"
        assert file in campaign.GPU_TESTS or f"{file}::{name}" in campaign.GPU_TESTS, \
            f"{file}::{name} runs only on a GPU but the campaign does not run it (bench.campaign.GPU_TESTS)"


class _Config:
    def __init__(self, bm, bn, w, s):
        self.kwargs, self.num_warps, self.num_stages = {"BLOCK_M": bm, "BLOCK_N": bn}, w, s


class _Tuner:
    keys = ["M", "N_KEYS", "HEAD_DIM"]

    def __init__(self):
        self.cache = {}


def test_autotuners_pinned_and_restored_and_their_choices_recorded():
    kernels = pinned_configs.tuned_kernels()
    names = pinned_configs.all_config_names()
    assert len(names) == len(set(names)) > 1 and set(campaign.PYTEST_CONFIGS) <= set(names)
    before = {n: list(k.configs) for n, k in kernels.items()}
    kernels["fwd_kernel_tuned"].cache[("a key",)] = kernels["fwd_kernel_tuned"].configs[0]
    try:
        with pinned_configs.pinned(["64x64w4s1"]):
            for k in kernels.values():
                assert [pinned_configs.config_name(c) for c in k.configs] == ["64x64w4s1"] and not k.cache
        assert {n: list(k.configs) for n, k in kernels.items()} == before
        assert ("a key",) in kernels["fwd_kernel_tuned"].cache
        with pytest.raises(ValueError, match="configs must be among"):
            with pinned_configs.pinned(["64x64w4s1", "1x1w1s1"]):
                pass
        assert {n: list(k.configs) for n, k in kernels.items()} == before  # nothing half-pinned
    finally:
        kernels["fwd_kernel_tuned"].cache.pop(("a key",), None)
    # the choices, as the campaign records them
    fwd = _Tuner()
    log = pinned_configs.TuningLog({"fwd_kernel_tuned": fwd})
    fast, slow = _Config(128, 64, 8, 2), _Config(64, 64, 4, 1)
    fwd.cache[(512, 896, 64, "torch.bfloat16", "torch.int32")] = fast
    fwd.configs_timings = {fast: [0.5, 0.4, 0.6], slow: [0.9, 0.8, 1.0]}
    recs = log.new("xlnet_fast fwd L=512") + log.new("again: nothing new")
    fwd.cache[(4096, 4480, 64, "torch.bfloat16")] = slow  # tuned without timings seen (e.g. two keys at once)
    fwd.cache[(2048, 2432, 64, "torch.bfloat16")] = slow
    fwd.configs_timings = {slow: [2.0, 1.9, 2.1]}
    recs += log.new("two keys")
    assert [(x["context"], x["best"]) for x in recs] == [("xlnet_fast fwd L=512", "128x64w8s2"),
                                                        ("two keys", "64x64w4s1"), ("two keys", "64x64w4s1")]
    assert recs[0]["key"] == {"M": 512, "N_KEYS": 896, "HEAD_DIM": 64, "dtypes": ["torch.bfloat16", "torch.int32"]}
    assert recs[0]["timings_ms"] == {"128x64w8s2": 0.5, "64x64w4s1": 0.9}
    assert recs[1]["timings_ms"] is None and recs[2]["timings_ms"] is None


def _gpu_like_records():
    base = {"run": "r", "t": 1.0, "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0",
            "date": "2026-12-01"}

    def attn(provider, mode, ms, status="ok"):
        return {**base, "step": "sweep", "op": "xlnet_attn", "status": status, "provider": provider, "mode": mode,
                "dtype": "bf16", "B": 32, "H": 16, "L": 512, "mlen": 384, "D": 64, "ms": ms,
                "tflops": None if ms == "OOM" else 1.0 / ms, "peak_mem_mb": 100.0}

    def step(provider, ms, tokens_per_s, peak_mem_mb):
        return {**base, "step": "pretrain", "op": "pretrain_step", "status": "ok", "provider": provider,
                "case": "base", "config": "base", "n_layer": 12, "B": 8, "L": 512, "mlen": 384, "num_predict": 85,
                "ms": ms, "tokens_per_s": tokens_per_s, "peak_mem_mb": peak_mem_mb}
    return [
        {**base, "step": "env", "op": "environment", "status": "ok", "sm_count": 132, "memory_gib": 79.2,
         "transformers": "5.17.0", "cuda": "13.0", "python": "3.12.3", "mode": "full"},
        {**base, "step": "env", "op": "ceiling_matmul", "status": "ok", "n": 8192, "dtype": "bf16", "ms": 1.4,
         "tflops": 785.0},
        attn("xlnet_fast", "fwd_bwd", 2.0), attn("sdpa_flash", "fwd_bwd", 1.5), attn("hf", "fwd_bwd", 30.0),
        attn("flex", "fwd_bwd", 6.0), attn("xlnet_fast", "fwd", 1.0), attn("sdpa_flash", "fwd", 0.4),
        attn("hf", "fwd", 8.0), attn("flex", "fwd", "OOM", status="oom"),
        step("xlnet_fast", 100.0, 40960.0, 10240.0), step("hf", 300.0, 13653.0, 20480.0),
        {**step("native-compiled", 50.0, 81920.0, 10240.0), "step": "model_step", "op": "model_step",
         "mode": "train", "gpu_ms": 45.5, "launches": 2000.0, "host_waits": 0.0, "host_ms": 38.25},
    ]


def test_report_prints_the_summary_and_the_readme_tables(tmp_path, capsys):
    path = tmp_path / "a.jsonl"
    # issue 33's 8x12 shape shares L and mlen with the sweep's first point: both rows, keyed by B and H
    # (the report once kept the later one only)
    small = [{**r, "B": 8, "H": 12, "ms": r["ms"] / 2} for r in _gpu_like_records()
             if r["op"] == "xlnet_attn" and r["provider"] in ("xlnet_fast", "sdpa_flash") and r["mode"] == "fwd_bwd"]
    path.write_text("".join(json.dumps(r) + "\n" for r in _gpu_like_records() + small) + '{"torn')
    out = tmp_path / "report"
    assert campaign.main(["--report", str(path), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "- fwd+bwd ≤ 2x SDPA-flash, D=64 L=512 mlen=384 32x16: 1.33x — met" in text
    assert "- fwd+bwd ≤ 2x SDPA-flash, D=64 L=512 mlen=384 8x12: 1.33x — met" in text
    assert "- ≥ 10x transformers' attention core, fwd_bwd, D=64 L=512 mlen=384 32x16: 15.0x — met" in text
    assert "- ≥ 10x transformers' attention core, fwd, D=64 L=512 mlen=384 32x16: 8.0x — missed by 1.25x" in text
    assert "a.jsonl:" in text and "not a JSON record" in text  # the torn line is named, not silently dropped
    readme = text[text.index("## README tables"):]
    assert "Measured on NVIDIA H100 80GB HBM3 (torch 2.11.0, triton 3.6.0, 2026-12-01" in readme
    assert "| 32×16 | 512 | 384 | 64 | fwd | 1 | 0.4 | OOM | 8 | 2.5 | 8 |" in readme
    assert "| 32×16 | 512 | 384 | 64 | fwd+bwd | 2 | 1.5 | 6 | 30 | 1.33 | 15 |" in readme
    assert "| 8×12 | 512 | 384 | 64 | fwd+bwd | 1 | 0.75 | – | – | 1.33 | – |" in readme
    # the older bench.pretrain_step's records read as training steps (its xlnet_fast is today's native)
    assert "| base | train | 12 | 8 | 512 | 384 | 85 | native | 40,960 | 100 | – | – | – | 10.0 | – | 3 | 0.5 |" in readme
    # a model step profiled on the GPU: its kernels' time, the host's time and waits beside the wall time
    assert "| native-compiled | 81,920 | 50 | 45.5 | 38.25 | 0 | 10.0 | – | 6 | 0.5 |" in readme
    assert sorted(p.name for p in out.iterdir()) == ["attention.png", "model_step.png", "summary.md"]
    assert campaign.main(["--report", str(path), "--out", str(out)]) == 2  # never over another report
    assert campaign.main(["--report", str(tmp_path / "missing.jsonl")]) == 2
    # a record a section cannot read costs that section only
    records = _gpu_like_records() + [{"run": "r", "step": "sweep", "t": 2.0, "device": "x", "op": "xlnet_attn",
                                      "status": "ok", "provider": "xlnet_fast"}]  # no shape fields
    text = campaign_report.summary_markdown(records)
    assert "## Attention" in text and "could not be made from the records: KeyError" in text
    assert "| base | train | 12 | 8 | 512 | 384 | 85 | native | 40,960 |" in text  # the other sections are there


def test_the_kernel_profile_is_reported_per_provider():
    """The first GPU run's most telling measurement, now a campaign record: each kernel's GPU time per
    call, the largest first, in the summary (all of them) and in what the campaign prints last (three)."""
    record = {"run": "r", "step": "sweep", "t": 1.0, "device": "x", "op": "kernel_profile", "status": "ok",
              "provider": "xlnet_fast", "mode": "fwd_bwd", "D": 64, "L": 512, "mlen": 384, "B": 32,
              "gpu_ms_per_call": 6.17, "launches_per_call": 60, "host_ms_per_call": 1.234,
              "kernels": [{"kernel": "_bwd_q_kernel", "ms_per_call": 1.653, "launches_per_call": 1},
                          {"kernel": "_bwd_kv_kernel", "ms_per_call": 1.239, "launches_per_call": 2},
                          {"kernel": "_fwd_kernel", "ms_per_call": 0.878, "launches_per_call": 1},
                          {"kernel": "other kernels (40)", "ms_per_call": 2.4, "launches_per_call": 56}]}
    full = campaign_report.summary_markdown([record])
    assert ("xlnet_fast fwd_bwd, D=64 L=512 mlen=384 B=32: 6.17 ms of GPU time in 60 launches, 1.23 ms of host "
            "time") in full
    # a record from before the host time was measured: none claimed
    older = campaign_report.summary_markdown([{k: v for k, v in record.items() if k != "host_ms_per_call"}])
    assert "in 60 launches\n" in older and "ms of host time" not in older
    assert "| _bwd_kv_kernel | 1.24 | 2 |" in full and "| other kernels (40) | 2.4 | 56 |" in full
    compact = campaign_report.summary_markdown([record], compact=True)
    assert "largest: _bwd_q_kernel 1.65, _bwd_kv_kernel 1.24, _fwd_kernel 0.878" in compact
    assert "other kernels" not in compact


def test_an_uninstalled_source_tree_imports_its_kernels(tmp_path):
    """As on the GPU machine: a copy of the repository, not pip-installed (python -S: no editable
    finder from a .pth file), finds xlnet_fast.kernels in kernels/ once ``bench`` is imported (any
    benchmark, or a program the campaign starts: bench/__init__.py)."""
    import shutil
    import site

    from bench import source_tree

    spec = source_tree._KernelsFinder().find_spec("xlnet_fast.kernels")
    assert Path(spec.origin) == ROOT / "kernels" / "__init__.py"
    assert spec.submodule_search_locations == [str(ROOT / "kernels")]
    assert source_tree._KernelsFinder().find_spec("xlnet_fast.other") is None
    assert source_tree.ensure_kernels_importable() is None  # importable here already: nothing added
    shutil.copytree(ROOT / "xlnet_fast", tmp_path / "xlnet_fast",
                    ignore=shutil.ignore_patterns("kernels", "__pycache__"))
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "bench").mkdir()
    for name in ("__init__.py", "source_tree.py"):
        shutil.copy(ROOT / "bench" / name, tmp_path / "bench" / name)
    code = ("import importlib.util\n"
            "assert importlib.util.find_spec('xlnet_fast.kernels') is None\n"
            "import bench.source_tree as s\n"
            "print(s.ensure_kernels_importable())\n"
            "import xlnet_fast.kernels as k\n"
            "print(k.__file__, k.available()[0])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *site.getsitepackages()]), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    note, where = proc.stdout.splitlines()
    assert note == f"xlnet_fast.kernels is not installed: importing it from {tmp_path / 'kernels'}"
    assert where == f"{tmp_path / 'kernels' / '__init__.py'} True"


def test_the_gpu_plans_measure_what_the_campaign_is_for():
    full = campaign.PLANS["full"]
    assert {"xlnet_fast", "xlnet_fast_det", "hf", "flex", "sdpa_flash"} <= set(full.providers)
    assert (full.sweep_dtype, campaign.SWEEP_MODES, full.sweep_D) == ("bf16", ("fwd", "fwd_bwd"), (64, 128))
    assert [(c.qlen, c.mlen, c.B, c.D) for c in full.sweep_cases()[:4]] == [
        (512, 384, 32, 64), (2048, 384, 8, 64), (4096, 384, 4, 64), (16384, 384, 1, 64)]
    items = campaign.sweep_items(full)
    assert items[0][0] == "agree" and [i[1].D for i in items] == sorted(i[1].D for i in items)  # D=64 first
    assert ("time", full.sweep_cases()[0], "fwd", "xlnet_fast_det") not in items  # same forward as xlnet_fast
    # where the GPU time goes, right after the first point's timings (not last, where the time box cuts)
    first, second = full.sweep_cases()[:2]
    profiled = [i for i, item in enumerate(items) if item[0] == "profile"]
    n = len(campaign.PROFILED)
    assert [items[i][3] for i in profiled[:n]] == list(campaign.PROFILED)
    extra = full.extra_cases(64)
    assert items[profiled[0] - 1][1] == first and items[profiled[n - 1] + 1][1] == extra[0]
    # then the shapes off the grid, then ours right after every later point's timings (the long
    # sequences, D=128): where its time goes
    expected = []
    for D in full.sweep_D:
        d_cases = [c for c in full.sweep_cases() if c.D == D]
        expected += [(d_cases[0], p) for p in campaign.PROFILED] + [(c, "xlnet_fast") for c in full.extra_cases(D)]
        expected += [(c, "xlnet_fast") for c in d_cases[1:]]
    assert [(items[i][1], items[i][3]) for i in profiled] == expected
    assert second in [items[i][1] for i in profiled]
    # issue 33's op target and issue 34's long one, then the H100's two anomalies (issue 34 item 4),
    # timed against SDPA-flash and eager as it measured them
    extras = [(c.B, c.H, c.qlen, c.mlen, c.D) for D in full.sweep_D for c in full.extra_cases(D)]
    assert extras == [(8, 12, 512, 384, 64), (1, 16, 8192, 0, 64), (2, 16, 2048, 0, 64), (4, 8, 1024, 0, 128)]
    for case in (c for D in full.sweep_D for c in full.extra_cases(D)):
        assert {(m, p) for kind, c, m, p in items if kind == "time" and c == case} == {
            (m, p) for m in campaign.SWEEP_MODES for p in campaign.ANOMALY_PROVIDERS}
    assert campaign.PLANS["quick"].extra_cases(64) == []
    assert all(items[i - 1][0] in ("time", "profile") and items[i - 1][1] == items[i][1] for i in profiled)
    checked = {(c.qlen, c.mlen, c.two_stream, dtype) for _, c, dtypes, _ in full.checks for dtype in dtypes}
    for qlen in (512, 4096):
        for two_stream in (False, True):
            assert (qlen, 384, two_stream, torch.bfloat16) in checked
    assert (512, 384, False, torch.float16) in checked and (512, 384, True, torch.float16) in checked
    assert any(det for *_, det in full.checks) and full.config_check is not None
    assert [(m.size, m.seq, m.mlen, m.predict) for _, m in full.models] == [("base", 512, 384, 85),
                                                                           ("large", 512, 384, 85)]
    assert "tests/test_hf_patch.py::test_convergence_bf16_on_gpu_is_close" in full.pytest_targets
    quick = campaign.PLANS["quick"]
    assert len(quick.sweep_cases()) == 1 and len(quick.models) == 1


def test_the_compile_step_compiles_for_the_checks_the_sweep_and_the_model_step_among_the_campaigns_steps():
    """``compile_calls``: the correctness step's float64 checks (each checked dtype, then the config
    check's case at each config), the sweep's calls, then the model step's (each size's training step
    and inference forward with the patched and the native model: the graphed and compiled native
    steps launch the native one's kernels, transformers' none), as far as those steps are in the
    campaign, in its order."""
    full = campaign.PLANS["full"]
    checks = [label for label, _ in campaign.correctness_calls(full)]
    sweep = [label for label, _ in campaign.sweep_calls(full)]
    model = [label for label, _ in campaign.model_step_calls(full)]
    n_checked = sum(len(dtypes) for _, _, dtypes, _ in full.checks)
    configs = pinned_configs.all_config_names()
    assert len(checks) == n_checked + len(configs) and checks[n_checked:] == \
        [f"check {full.config_check[0]} bfloat16 at {config}" for config in configs]
    assert model == [f"model_step {size} {provider} {mode}" for size in ("base", "large")
                     for provider in ("patched", "native") for mode in ("train", "infer")]

    def labels(*steps):
        return [label for label, _ in campaign.compile_calls(dataclasses.replace(full, steps=steps))]

    assert labels(*campaign.STEPS) == checks + sweep + model
    assert labels("env", "compile", "model_step", "plots") == model  # the runbook's call B
    assert labels("env", "compile", "ncu") == []


def test_the_compile_step_makes_the_sweeps_calls_of_our_kernels_in_its_order():
    """``sweep_calls``: each forward and forward+backward the sweep times of a provider running our
    kernels, once, in the sweep's order (what it compiles ahead is first needed first)."""
    full = campaign.PLANS["full"]
    timed = [f"{p} {m} D={c.D} {c.B}x{c.H} {c.qlen}/{c.mlen}" for kind, c, m, p in campaign.sweep_items(full)
             if kind == "time" and p.startswith("xlnet_fast")]
    assert [label for label, _ in campaign.sweep_calls(full)] == list(dict.fromkeys(timed))
