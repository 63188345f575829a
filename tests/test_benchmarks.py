"""CPU benchmarks (pytest-benchmark) of the eager op and the model forward; CI passes
--benchmark-disable (pyproject addopts), so each runs once as a test. Measure with
``python -m pytest tests/test_benchmarks.py --benchmark-enable``. Also checks that the attention
benchmark's providers compute the same attention."""

import pytest
import torch

import xlnet_fast
from bench import attention


def test_bench_providers_agree():
    t, c = attention.make_case(B=1, H=2, qlen=24, mlen=8, D=16, dtype=torch.float32, device="cpu")
    out = {n: attention.runner(n, dict(t), c)() for n in ("eager", "hf")}
    hf = out["hf"].transpose(0, 1)  # HF's (len, B, H, D)
    torch.testing.assert_close(out["eager"], hf, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("L", [128, 512])
def test_benchmark_eager_op_fwd_bwd(benchmark, L):
    t, c = attention.make_case(B=1, H=4, qlen=L, mlen=0, D=64, dtype=torch.float32, device="cpu")
    step = attention.provider_fn("eager", t, c, "fwd_bwd")
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


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    from bench import plot

    recs = [{"op": "xlnet_attn", "device": "Fake GPU", "dtype": "bf16", "D": 64, "mlen": 0, "mode": "fwd",
             "provider": p, "L": L, "ms": ("OOM" if (p == "hf" and L == 4096) else L / 100)}
            for p in ("xlnet_fast", "hf") for L in (512, 4096)]
    (tmp_path / "attention.json").write_text(json.dumps(recs))
    assert plot.main(["--results", str(tmp_path)]) == 0
    assert list(tmp_path.glob("attention_fake-gpu_bf16_D64_mlen0_fwd.png"))
