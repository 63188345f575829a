"""CPU benchmarks (pytest-benchmark) of the eager op and the model forward; CI passes
--benchmark-disable (pyproject addopts), so each runs once as a test. Measure with
``python -m pytest tests/test_benchmarks.py --benchmark-enable``. Also checks the bench scripts: the
attention benchmark's providers (transformers', FlexAttention's) compute the same attention, the shared case builders
(``bench.cases``) draw the inputs the scripts' own builders drew, and a bench command run without
``--record`` writes nothing inside the repository."""

import json
import os
from pathlib import Path

import pytest
import torch

import xlnet_fast
from bench import attention, cases, cpu_vs_hf, gpu_check, model_step, plot, runner

ROOT = Path(__file__).resolve().parents[1]
NOT_REPO_CONTENT = {".git", "__pycache__", ".pytest_cache", ".hypothesis"}


def test_bench_providers_agree():
    inputs = cases.attention_inputs(cases.AttentionCase(B=1, H=2, qlen=24, mlen=8, D=16, dtype=torch.float32))
    out = {n: attention.provider_call(n, inputs, dict(inputs.floats))() for n in ("eager", "hf")}
    hf = out["hf"].transpose(0, 1)  # HF's (len, B, H, D)
    torch.testing.assert_close(out["eager"], hf, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(attention.provider_output("hf", inputs), out["eager"])  # (B, M, H, D) like the op


@pytest.mark.parametrize("extra", [dict(), dict(segments=False), dict(ranks="pretraining", targets=6)])
def test_flex_provider_computes_xlnet_attention(extra):
    """bench.attention's ``flex`` provider (FlexAttention as a user writes XLNet attention: bd
    gathered in a score_mod with the segment term, ranks and each row's own key as a block mask) gives
    the op's output. Forward only: torch has no FlexAttention backward on CPU (it raises), and the
    compiled path needs a GPU; the campaign measures both there. With pretraining ranks the targets'
    own keys are visible only through the mask_mod's own-key clause."""
    case = cases.AttentionCase(B=2, H=2, qlen=24, mlen=8, D=16, dtype=torch.float32, seed=3, **extra)
    inputs = cases.attention_inputs(case)
    flex = attention.provider_output("flex", inputs)
    assert flex.shape == (2, 24, 2, 16)
    torch.testing.assert_close(flex, attention.provider_output("eager", inputs), rtol=1e-4, atol=1e-5)


def test_flex_is_skipped_past_the_position_score_table_measured_to_run():
    """Regression (first GPU run): FlexAttention at L=16384 (an 8.7e9-element position-score table)
    hit an illegal memory access that lost the CUDA context for the rest of the sweep; its backward
    did the same at L=4096, B=4 (2.25e9 elements, H200, 2026-11-27), where its forward runs."""
    largest_run = cases.AttentionCase(B=4, H=16, qlen=4096, mlen=384, D=64)
    crashed = cases.AttentionCase(B=1, H=16, qlen=16384, mlen=384, D=64)
    assert attention.unavailable("flex", "fwd", "cuda", largest_run) is None
    assert "in fwd_bwd" in attention.unavailable("flex", "fwd_bwd", "cuda", largest_run)
    assert attention.unavailable("flex", "fwd_bwd", "cuda", cases.AttentionCase(B=8, H=16, qlen=2048, mlen=384, D=64)) is None
    assert "position scores" in attention.unavailable("flex", "fwd_bwd", "cuda", crashed)
    assert attention.unavailable("xlnet_fast", "fwd", "cuda", crashed) is None


@pytest.mark.parametrize("L", [128, 512])
def test_benchmark_eager_op_fwd_bwd(benchmark, L):
    inputs = cases.attention_inputs(cases.AttentionCase(B=1, H=4, qlen=L, mlen=0, D=64, dtype=torch.float32))
    step = attention.provider_fn("eager", inputs, "fwd_bwd")
    benchmark(step)


def test_benchmark_model_forward(benchmark):
    torch.manual_seed(0)
    cfg = xlnet_fast.XLNetConfig(vocab_size=1000, d_model=256, n_layer=2, n_head=4, d_inner=512,
                                 dropout=0.0, attn_backend="eager")
    model = xlnet_fast.XLNetModel(cfg).eval()
    ids = torch.randint(9, 1000, (2, 256))

    def step():
        with torch.no_grad():
            return model(ids, use_mems=False).last_hidden_state

    out = benchmark(step)
    assert out.shape == (2, 256, 256)


def test_plot_writes_pngs_and_without_record_to_the_cache(tmp_path, cache):
    pytest.importorskip("matplotlib")
    assert plot.main([]) == 0  # the repository's records
    assert (cache / "cpu_vs_hf.png").exists()
    recs = [{"op": "xlnet_attn", "device": "Fake GPU", "dtype": "bf16", "D": 64, "mlen": 0, "mode": "fwd",
             "provider": p, "L": L, "ms": ("OOM" if (p == "hf" and L == 4096) else L / 100)}
            for p in ("xlnet_fast", "hf") for L in (512, 4096)]
    (tmp_path / "attention.json").write_text(json.dumps(recs))
    assert plot.main(["--results", str(tmp_path), "--out", str(tmp_path)]) == 0
    assert list(tmp_path.glob("attention_fake-gpu_bf16_D64_mlen0_fwd.png"))


# --------------------------------------------------------------------------------------------------
# The shared case builders
# --------------------------------------------------------------------------------------------------


def _draws(g, shapes_scales, dtype):
    """What the scripts' own builders drew: each tensor in turn from one generator, scaled, cast."""
    draw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return [(torch.randn(*shape, generator=g, dtype=draw_dtype) * s).to(dtype) for shape, s in shapes_scales]


def test_attention_case_floats_are_the_old_builders_draws():
    B, H, L, mlen, D = 2, 3, 8, 4, 5
    heads = (H, D)
    content = [((B, L, *heads), 1), ((B, L + mlen, *heads), 1), ((B, L + mlen, *heads), 1),
               ((1, 2 * L + mlen, *heads), 1), (heads, 0.1), (heads, 0.1), (heads, 0.1), ((2, *heads), 0.1)]
    # bench.attention's make_case: content stream, float32 draws cast to the benchmark dtype
    got = cases.attention_inputs(cases.AttentionCase(B, H, L, mlen, D, torch.bfloat16, seed=7)).floats
    expected = _draws(torch.Generator().manual_seed(7), content, torch.bfloat16)
    assert list(got) == ["q", "k", "v", "k_r", "r_w_bias", "r_r_bias", "r_s_bias", "seg_embed"]
    for (name, tensor), want in zip(got.items(), expected):
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, want), name
    # bench.gpu_check's make_inputs: two streams (q_g right after q_h), float64 draws
    case = cases.AttentionCase(B, H, L, mlen, D, torch.float64, targets=3, two_stream=True)
    got = cases.attention_inputs(case).floats
    expected = _draws(torch.Generator().manual_seed(0), [content[0], ((B, 3, *heads), 1)] + content[1:],
                      torch.float64)
    assert list(got)[:2] == ["q_h", "q_g"]
    for (name, tensor), want in zip(got.items(), expected):
        assert torch.equal(tensor, want), name
    meta = cases.attention_inputs(case, "meta")
    assert {k: (v.shape, v.dtype) for k, v in meta.floats.items()} == {k: (v.shape, v.dtype) for k, v in got.items()}
    assert all(v.device.type == "meta" for v in [*meta.floats.values(), *meta.index.values()])


def _compile_report_index_data(B, L, mlen, P, two_stream):
    """The index data the compile report's scenario builder (then ``bench.sm90``) drew before
    bench.cases existed."""
    from xlnet_fast import masks

    g = torch.Generator().manual_seed(0)
    order = torch.argsort(torch.rand(B, L, generator=g), dim=1)
    rank = torch.argsort(order, dim=1).to(torch.int32)
    is_target = rank >= L - P
    target_pos = torch.sort(torch.argsort(rank, dim=1, descending=True)[:, :P], dim=1).values
    token_type = (torch.arange(L) >= torch.randint(L // 4, L, (B, 1), generator=g)).long()
    out = dict(q_rank=torch.where(is_target, rank, 0), k_rank=masks.with_memory(torch.where(is_target, rank, -1), mlen),
               q_seg=token_type, k_seg=torch.cat([torch.zeros(B, mlen, dtype=torch.long), token_type], 1))
    return {**out, "target_pos": target_pos} if two_stream else out


@pytest.mark.parametrize("two_stream", [False, True])
def test_pretraining_ranks_are_the_compile_report_scenario_index_data(two_stream):
    B, L, mlen, P = 3, 32, 8, 6
    case = cases.AttentionCase(B, 2, L, mlen, 4, targets=P, two_stream=two_stream, ranks="pretraining")
    got = cases.attention_inputs(case).index
    expected = _compile_report_index_data(B, L, mlen, P, two_stream)
    assert list(got) == list(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name]), name


def test_permutation_ranks_segments_and_targets():
    B, L, mlen, P = 4, 40, 8, 7
    case = cases.AttentionCase(B, 2, L, mlen, 4, targets=P, two_stream=True, seed=3)
    index = cases.attention_inputs(case).index
    rank = index["k_rank"][:, mlen:]
    assert (index["k_rank"][:, :mlen] == xlnet_fast.INT32_MIN).all()  # memory: always visible
    assert torch.equal(rank.sort(dim=1).values, torch.arange(L, dtype=torch.int32).expand(B, L))
    assert torch.equal(index["q_rank"], rank + 1)  # a position sees itself and what precedes it
    assert torch.equal(index["target_pos"], (rank >= L - P).nonzero()[:, 1].view(B, P))  # last P of the order
    seg = index["q_seg"]
    boundary = (seg == 0).sum(1)
    assert ((boundary >= L // 4) & (boundary < L)).all() and torch.equal(seg, seg.sort(dim=1).values)
    assert torch.equal(index["k_seg"], torch.cat([torch.zeros(B, mlen, dtype=torch.long), seg], 1))
    no_segments = cases.attention_inputs(cases.AttentionCase(B, 2, L, mlen, 4, segments=False))
    assert "q_seg" not in no_segments.index and "seg_embed" not in no_segments.floats


@pytest.mark.parametrize("bad", [dict(ranks="dense"), dict(two_stream=True), dict(ranks="pretraining"),
                                 dict(targets=41), dict(mlen=-1), dict(H=0)])
def test_attention_case_rejects_inconsistent_fields(bad):
    with pytest.raises(ValueError):
        cases.AttentionCase(**{**dict(B=1, H=2, qlen=40, mlen=0, D=4), **bad})


def test_pretraining_batch_masks_agree():
    case = cases.ModelCase("tiny", B=3, seq=24, mlen=5, predict=4, vocab=100, seed=2)
    batch = cases.pretraining_batch(case)
    assert torch.equal(batch["ids"], cases.token_ids(case))  # the ids are the generator's first draw
    assert torch.equal(batch["perm_mask"], (batch["q_rank"][:, :, None] <= batch["k_rank"][:, None, :]).float())
    assert torch.equal(batch["target_mapping"].argmax(-1), batch["target_pos"])
    assert torch.equal(batch["target_mapping"].sum(-1), torch.ones(3, 4))
    assert torch.equal(batch["labels"], batch["ids"].gather(1, batch["target_pos"]))
    assert [m.shape for m in batch["mems"]] == [(5, 3, case.dims["d_model"])] * case.dims["n_layer"]
    again = cases.pretraining_batch(case)
    assert all(torch.equal(batch[k], again[k]) for k in batch if k != "mems")


# --------------------------------------------------------------------------------------------------
# Where the bench scripts write
# --------------------------------------------------------------------------------------------------


def _repo_files() -> dict:
    """{path: (size, mtime)} of every file of the repository (git's and caches' folders excluded)."""
    files = {}
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in NOT_REPO_CONTENT and not d.endswith(".egg-info")]
        for name in names:
            st = os.stat(os.path.join(folder, name))
            files[os.path.relpath(os.path.join(folder, name), ROOT)] = (st.st_size, st.st_mtime_ns)
    return files


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The bench cache directory, moved into tmp_path; asserts the repository is left as it was."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    before = _repo_files()
    yield tmp_path / "xlnet_fast" / "bench"
    assert _repo_files() == before, "a bench command changed files inside the repository"


@pytest.mark.parametrize("module, name", [(attention, "attention.json"), (gpu_check, "gpu_check.json"),
                                          (model_step, "model_step.json"), (cpu_vs_hf, "cpu_vs_hf.json"),
                                          (plot, "")])
def test_output_goes_to_the_cache_unless_recorded(cache, module, name):
    parser = module.build_parser()
    assert runner.output_path(parser.parse_args([]), name) == cache / name
    assert runner.output_path(parser.parse_args(["--record"]), name) == ROOT / "bench" / "results" / name
    assert runner.output_path(parser.parse_args(["--out", "x"]), name) == Path("x")
    with pytest.raises(SystemExit):
        parser.parse_args(["--record", "--out", "x"])
    if module in (attention, model_step, cpu_vs_hf):  # they had --no-record: print only
        assert runner.output_path(parser.parse_args(["--no-record"]), name) is None


def test_cpu_vs_hf_without_record_writes_to_the_cache(cache, monkeypatch, capsys):
    for key, value in cpu_vs_hf._ENV.items():  # already set: no re-exec
        monkeypatch.setenv(key, value)
    assert cpu_vs_hf.main(["--size", "tiny", "--seq", "8", "--layers", "1", "--repeats", "1"]) == 0
    [record] = json.loads((cache / "cpu_vs_hf.json").read_text())
    assert record["op"] == "cpu_model_vs_hf" and record["L"] == 8 and set(record["modes"]) == {"fwd", "fwd_bwd"}
    assert record["max_abs_output_diff"] < 1e-4
    assert "about" in capsys.readouterr().err  # said how long it would take


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_attention_on_cpu_runs_a_small_sweep_and_refuses_a_long_one(cache, capsys):
    argv = ["--qlens", "16", "--mlens", "0", "4", "--B", "1", "--H", "2", "--D", "8", "--dtypes", "fp32"]
    assert attention.main(argv) == 0
    records = json.loads((cache / "attention.json").read_text())
    assert sorted({(r["provider"], r["mode"], r["mlen"]) for r in records}) == sorted(
        (p, m, mlen) for p in ("eager", "hf") for m in ("fwd", "fwd_bwd") for mlen in (0, 4))
    assert all(r["ms"] > 0 and r["L"] == 16 for r in records)
    capsys.readouterr()
    assert attention.main([]) == 2  # the GPU sweep (qlen up to 16384) on this CPU
    err = capsys.readouterr().err
    assert "would take about" in err and "--qlens" in err
    assert len(json.loads((cache / "attention.json").read_text())) == len(records)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_attention_pins_configs_and_refuses_unknown_ones_and_kernel_times_without_a_gpu(cache, capsys):
    """``--configs`` pins the autotuned kernels for the run (no tuning: what ncu needs) and restores
    them; a config no kernel has, and ``--kernels`` (GPU profiler) on a CPU, are one-line refusals."""
    from bench.compiler import pinned_configs

    before = {name: list(k.configs) for name, k in pinned_configs.tuned_kernels().items()}
    small = ["--qlens", "16", "--mlens", "0", "--B", "1", "--H", "2", "--D", "8", "--dtypes", "fp32", "--modes", "fwd",
             "--providers", "eager"]
    assert attention.main(small + ["--configs", "64x64w4s1"]) == 0
    assert {name: list(k.configs) for name, k in pinned_configs.tuned_kernels().items()} == before
    capsys.readouterr()
    assert attention.main(small + ["--configs", "65x64w4s1"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert attention.main(small + ["--kernels"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_model_step_on_cpu_measures_every_provider_and_mode_and_refuses_a_long_run(cache, capsys):
    """bench.model_step (the campaign's model_step step) on a tiny model: transformers, the patched
    model, the native one and the native one compiled, training step and inference forward, the same
    weights; and the old size name of bench.pretrain_step, its predecessor."""
    argv = ["--config", "mini", "--B", "2", "--seq", "16", "--mem", "8", "--predict", "4", "--infer-B", "2",
            "--vocab", "100", "--repeats", "1"]
    assert model_step.main(argv) == 0
    records = json.loads((cache / "model_step.json").read_text())
    assert sorted((r["provider"], r["mode"]) for r in records) == sorted(
        (p, m) for p in model_step.DEFAULT_PROVIDERS for m in model_step.MODES)
    assert all(r["status"] == "ok" and r["config"] == "tiny" and r["tokens_per_s"] > 0 for r in records)
    assert all(r["speedup_vs_hf"] == 1.0 for r in records if r["provider"] == "hf")
    assert all(r["mfu"] is None for r in records)  # no peak on a CPU
    capsys.readouterr()
    assert model_step.main([]) == 2  # XLNet-base, B=8, seq 512 on this CPU
    assert "would take about" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_model_step_graphed_provider_refuses_without_cuda_and_captures_once(cache, capsys, monkeypatch):
    """``native-graphed`` needs CUDA: on a CPU one line and exit status 2, nothing written. Its
    step warms up eagerly, captures one graph on its first call and only replays after (the CUDA
    calls faked: the order of eager runs, the capture and the replays)."""
    import contextlib

    assert model_step.main(["--config", "tiny", "--providers", "native", "native-graphed"]) == 2
    assert "native-graphed captures CUDA graphs and needs a CUDA device" in capsys.readouterr().err
    assert not cache.exists()
    with pytest.raises(ValueError, match="needs a CUDA device"):
        model_step.train_step("native-graphed", None, {}, "cpu")

    events = []

    class Graph:
        def replay(self):
            events.append("replay")

    @contextlib.contextmanager
    def capture(graph):
        events.append("capture")
        yield

    fake_stream = type("Stream", (), {"wait_stream": lambda self, other: None})
    monkeypatch.setattr(torch.cuda, "Stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    step = model_step._graphed(lambda capturing: events.append("captured work" if capturing else "eager"), warmup=2)
    assert events == []
    step()
    step()
    assert events == ["eager", "eager", "capture", "captured work", "replay", "replay"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_gpu_check_refuses_without_a_gpu(cache, capsys):
    assert gpu_check.main([]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert not cache.exists()


def test_runner_sweep_order_and_records(tmp_path):
    assert runner.sweep(a=[1, 2], b="xy") == [dict(a=1, b="x"), dict(a=1, b="y"), dict(a=2, b="x"), dict(a=2, b="y")]
    path = tmp_path / "r" / "records.json"
    runner.append_records(path, [{"n": 1}])
    runner.append_records(path, [{"n": 2}])
    assert json.loads(path.read_text()) == [{"n": 1}, {"n": 2}]
    assert [p.name for p in path.parent.iterdir()] == ["records.json"]  # no temporary file left
    path.write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        runner.append_records(path, [{"n": 3}])


def test_gpu_profile_sums_the_kernels_and_times_the_host_per_call(monkeypatch):
    """``runner.gpu_profile`` (CUDA only; torch's profiler and CUDA's synchronize faked here): the
    kernels' time per call, the largest first, the host waits less the profile's own closing one,
    and the host's time per call from HOST_TIMED_CALLS calls each after a synchronize, outside the
    profile."""
    import torch.profiler

    events = []

    class Event:
        def __init__(self, key, us, count):
            self.key, self.self_device_time_total, self.count = key, us, count

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            events.append("profile on")
            return self

        def __exit__(self, *exc):
            events.append("profile off")

        def key_averages(self):
            return [Event("_fwd_kernel", 600.0, 2), Event("_bwd_q_kernel", 900.0, 2),
                    Event("cudaDeviceSynchronize", 0.0, 3)]

    clock = iter(range(100))
    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    monkeypatch.setattr(runner.time, "perf_counter", lambda: next(clock) * 0.5e-3)  # each call 0.5 ms
    found = runner.gpu_profile(lambda: events.append("step"), calls=2)
    assert [k["kernel"] for k in found["kernels"]] == ["_bwd_q_kernel", "_fwd_kernel"]
    assert found["gpu_ms_per_call"] == pytest.approx(0.75) and found["launches_per_call"] == 2
    assert found["host_waits_per_call"] == 1.0  # 3 synchronizes, the profile's own closing one not counted
    assert found["host_ms_per_call"] == pytest.approx(0.5)
    timed = events[events.index("profile off") + 1:]
    assert timed == ["step", "sync"] * runner.HOST_TIMED_CALLS  # each timed call from an idle GPU
