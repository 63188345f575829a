"""The kernels' autotune candidates per GPU architecture (what each device times) and the rule that
drops configs a device cannot launch. What the candidates compile to is the compile report's subject
(tests/test_compile_report.py)."""

import pytest
import triton

from xlnet_fast.kernels import rel_attention as ra

ARCHS = (70, 75, 80, 86, 87, 89, 90, 100, 103, 120, 121)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("role", ra.ROLES)
def test_every_arch_and_kernel_has_banded_candidates(arch, role):
    configs = ra.configs_for(arch, 64, role)
    names = [ra.config_name(c) for c in configs]
    assert len(configs) >= 2 and len(set(names)) == len(names)
    assert all(c.kwargs["BLOCK_M"] <= c.kwargs["BLOCK_N"] for c in configs)  # banded tiles need it
    # the dQ kernel reads a tile's column numbers from a table of COLUMN_NUMBERS (a static assert,
    # which only a compile for a GPU would reach)
    assert all(c.kwargs["BLOCK_N"] <= ra.COLUMN_NUMBERS for c in configs)
    assert set(names) <= {ra.config_name(c) for c in ra.all_configs()}  # the autotuners know them


@pytest.mark.parametrize("arch", [80, 86, 89, 120])
def test_mma_sync_architectures_cap_registers_at_255(arch):
    """Regression: without a cap ptxas gave sm_80's dQ build 32 registers and ~30 KB of spill."""
    for role in ra.ROLES:
        assert all(c.maxnreg == 255 for c in ra.configs_for(arch, 64, role)), role


def test_config_names_round_trip():
    for config in ra.all_configs():
        again = ra._config(ra.config_name(config))
        assert (again.kwargs, again.num_warps, again.num_stages, again.maxnreg) == (
            config.kwargs, config.num_warps, config.num_stages, config.maxnreg)
    assert ra.config_name(ra._config("32x32w4s1r255")) == "32x32w4s1r255"


def test_launchable_uses_each_architectures_limits():
    assert ra.launchable(80, 166_912) and not ra.launchable(80, 166_913)
    assert ra.launchable(89, 101_376) and not ra.launchable(89, 101_377)
    assert ra.launchable(120, 101_376) and not ra.launchable(121, 101_377)
    assert ra.launchable(90, 232_448) and not ra.launchable(90, 232_449)
    assert ra.launchable(100, 1000, tmem_columns=512) and not ra.launchable(100, 1000, tmem_columns=672)


@pytest.mark.parametrize("arch", [80, 89, 90, 100])
def test_autotuner_prune_offers_the_architectures_candidates(arch):
    prune = ra._prune("dq", ra._bwd_q_kernel)
    with ra.compiling_for(arch):
        kept = prune(ra.all_configs(), {}, HEAD_DIM=64)
    assert [ra.config_name(c) for c in kept] == [ra.config_name(c) for c in ra.configs_for(arch, 64, "dq")]


def test_autotuner_prune_keeps_configs_pinned_outside_the_candidates():
    prune = ra._prune("fwd", ra._fwd_kernel)
    pinned = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    with ra.compiling_for(90):
        assert prune(pinned, {}, HEAD_DIM=64) == pinned


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="role"):
        ra.configs_for(90, 64, "dv")


def test_on_a_device_the_prune_keeps_what_launches_in_candidate_order(monkeypatch):
    """The GPU path, with the device and the compile-and-check replaced: candidates of the device's
    arch, in order, minus those that would not launch; an error naming the device when none does."""
    import torch

    monkeypatch.setattr(ra, "_device_arch", lambda device: 90)
    monkeypatch.setattr(ra, "_launches_on_device", lambda fn, args, config: config.kwargs["BLOCK_M"] <= 32)
    args = {"QW": torch.empty(1), "HEAD_DIM": 64}
    expected = [ra.config_name(c) for c in ra.configs_for(90, 64, "dq") if c.kwargs["BLOCK_M"] <= 32]
    kept = ra._prune("dq", ra._bwd_q_kernel)(ra.all_configs(), {}, **args)
    assert [ra.config_name(c) for c in kept] == expected
    assert ra.config_name(ra.first_launchable("dq", ra._bwd_q_kernel, args)) == expected[0]
    monkeypatch.setattr(ra, "_launches_on_device", lambda fn, args, config: False)
    with pytest.raises(RuntimeError, match="sm_90"):
        ra._prune("dq", ra._bwd_q_kernel)(ra.all_configs(), {}, **args)
    with pytest.raises(RuntimeError, match="sm_90"):
        ra.first_launchable("dq", ra._bwd_q_kernel, args)


def test_the_autotuners_own_prune_call_compiles_with_the_kernels_arguments_only(monkeypatch):
    """Regression (first GPU run, triton 3.6): the autotuner hands ``early_config_prune`` its launch
    options ``grid`` and ``warmup`` with the kernel's arguments; passed on to the compile, every tuned
    launch raised "warmup() got multiple values for keyword argument 'grid'"."""
    import torch

    seen = []
    monkeypatch.setattr(ra, "_device_arch", lambda device: 90)
    monkeypatch.setattr(ra, "_launches_on_device", lambda fn, args, config: seen.append(set(args)) or True)
    tuner = ra.bwd_q_kernel_tuned
    tuner.nargs = {"QW": torch.empty(1)}
    try:
        kept = tuner.prune_configs({"HEAD_DIM": 64, "grid": (1,), "warmup": False})
    finally:
        tuner.nargs = None
    assert [ra.config_name(c) for c in kept] == [ra.config_name(c) for c in ra.configs_for(90, 64, "dq")]
    assert seen and all(args == {"QW", "HEAD_DIM"} for args in seen)


def test_when_no_candidate_fits_the_prune_takes_another_config_that_does(monkeypatch):
    """Regression (first GPU run): the suite pinned to 64x64w4s1 gave an fp32 D=96 dK/dV launch
    278,528 B of shared memory on an H200 (232,448 B allowed); a smaller config among the autotuner's
    is taken instead."""
    import torch

    monkeypatch.setattr(ra, "_device_arch", lambda device: 90)
    monkeypatch.setattr(ra, "_launches_on_device", lambda fn, args, config: config.kwargs["BLOCK_N"] == 32)
    pinned = [ra._config("64x64w4s1"), ra._config("32x32w4s1")]
    kept = ra._prune("dkdv", ra._bwd_kv_kernel)(pinned, {}, QW=torch.empty(1), HEAD_DIM=128)
    assert [ra.config_name(c) for c in kept] == ["32x32w4s1"]


@pytest.fixture
def tf32_switch():
    import torch

    before = torch.backends.cuda.matmul.allow_tf32
    yield lambda allowed: setattr(torch.backends.cuda.matmul, "allow_tf32", allowed)
    torch.backends.cuda.matmul.allow_tf32 = before


def test_fp32_dots_follow_torchs_tf32_switch_and_never_use_fma(tf32_switch, monkeypatch):
    """Regression: fp32 inputs with TF32 off compiled to FFMA dots (32 registers, 56-170 KB spill)."""
    import torch

    from xlnet_fast import kernels

    monkeypatch.setattr(kernels, "INTERPRETED", False)  # as compiled for a GPU
    tf32_switch(True)
    assert kernels.fp32_precision() == "tf32" and kernels._input_precision(torch.float32) == "tf32"
    tf32_switch(False)
    assert kernels.fp32_precision() == "tf32x3" and kernels._input_precision(torch.float32) == "tf32x3"
    assert kernels._input_precision(torch.bfloat16) == "ieee"  # 16-bit products are exact


def test_info_says_how_fp32_inputs_are_multiplied(tf32_switch, monkeypatch):
    import torch

    from xlnet_fast.attention import backends

    monkeypatch.setattr(backends, "triton_status", lambda: (True, ""))
    tf32_switch(False)
    line = backends.explain_auto_backend(torch.device("cuda"))
    assert line.startswith("triton") and "3xTF32" in line and "highest" in line
    tf32_switch(True)
    assert "TF32 dots" in backends.explain_auto_backend(torch.device("cuda"))
