"""The op's host path, as a GPU would run it: masks prepared once per forward, no host sync, and the
launches a layer call makes (issue 33). On CPU the Triton kernels' launches are counted instead of run
(the launcher's one launch point, ``kernels._run``; the interpreter is not needed to count), PyTorch's
ops are counted by ``bench.host_cost``'s dispatch mode (the ones that would run a GPU kernel), and
checks of tensor values take their GPU form (assertions on the device, ``args.check_values``), so
that a read of a tensor on the host is a sync the GPU would pay. The figures in µs are
``python -m bench.host_cost``'s (bench/NOTES.md); no test here times anything.
"""

import contextlib

import pytest
import torch
from helpers.models import SMALL

import xlnet_fast
from xlnet_fast import XLNetLMHeadModel
from xlnet_fast.config import XLNetConfig
from xlnet_fast.attention import args as op_args

B, L, P, MLEN, H, D = 2, 16, 3, 8, 2, 16
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def gpu_like(monkeypatch):
    """Kernel launches counted (by role) instead of run; checks of values on the device."""
    from xlnet_fast import kernels

    launched = []

    def run(role, grid, plan, tensors, deterministic, config=None):
        launched.append(role)
        return kernels._k.INTERPRETER_TILES

    monkeypatch.setattr(kernels, "_run", run)
    monkeypatch.setattr(op_args, "host_value_checks", lambda device: False)
    return launched


@contextlib.contextmanager
def host_reads():
    """Every read of a tensor's value on the host, by the method that read it."""
    reads, saved = [], {name: getattr(torch.Tensor, name) for name in READS}

    def spy(name):
        def read(self, *args):
            reads.append(name)
            return saved[name](self, *args)
        return read

    for name in READS:
        setattr(torch.Tensor, name, spy(name))
    try:
        yield reads
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def layer_call():
    """The call each layer of pretraining makes: both streams, ranks, segments, dropout, masks
    prepared once; returns (call, differentiable inputs, upstream gradients)."""
    g = torch.Generator().manual_seed(0)
    K = MLEN + L
    leaves = [torch.randn(*shape, generator=g).requires_grad_() for shape in
              ((B, L, H, D), (B, P, H, D), (B, K, H, D), (B, K, H, D), (1, K + L, H, D), (H, D), (H, D), (H, D),
               (2, H, D))]
    masks = xlnet_fast.prepare_two_stream_masks(
        B, L, K, device="cpu", target_pos=torch.randint(-1, L, (B, P), generator=g),
        q_seg=torch.randint(0, 2, (B, L), generator=g), k_seg=torch.randint(0, 2, (B, K), generator=g),
        q_rank=torch.randint(0, L, (B, L), generator=g, dtype=torch.int32),
        k_rank=torch.randint(0, L, (B, K), generator=g, dtype=torch.int32), backend="triton")

    def call():
        *dense, r_s_bias, seg_embed = leaves
        return xlnet_fast.rel_attention_two_stream(*dense, r_s_bias=r_s_bias, seg_embed=seg_embed, masks=masks,
                                                   dropout_p=0.1, backend="triton")

    return call, leaves, [torch.randn(B, L, H, D), torch.randn(B, P, H, D)]


def test_a_layer_call_makes_at_most_4_launches_forward_and_9_with_backward(gpu_like):
    """Both streams in one launch, the tables prepared beforehand, the gradients of k_r, the biases
    and seg_embed in two passes: forward = the dropout seed's draw, the query operands, the forward
    kernel; backward = dO's operands with the query operands again (kept, they would cost 2x q's
    memory per layer) in one pass, which also clears dk_r's sums, dK/dV and its segment fix-up, dQ,
    the sums per batch row and head (with dk_r's conversion), their sum per head. Counted at the
    second call: the first on a device also makes the dQ kernel's column numbers
    (``kernels._column_numbers``, once per device)."""
    from bench.host_cost import _CountOps

    call, leaves, upstream = layer_call()
    torch.autograd.grad(call(), leaves, upstream)
    del gpu_like[:]
    with _CountOps() as ops:
        outputs = call()
    forward = gpu_like + [f"torch.{name}" for name, n in ops.ops.items() for _ in range(n)]
    assert len(forward) <= 4, forward
    del gpu_like[:]
    with _CountOps() as ops:
        torch.autograd.grad(outputs, leaves, upstream)
    backward = gpu_like + [f"torch.{name}" for name, n in ops.ops.items() for _ in range(n)]
    assert len(forward) + len(backward) <= 9, (forward, backward)
    assert gpu_like == ["gops", "dkdv", "fixup", "dq", "finish", "heads"] and ops.ops == {}, (gpu_like, ops.ops)


def test_a_call_on_another_gpus_tensors_launches_with_that_gpu_current(monkeypatch):
    """Triton launches on its driver's current device, not on the tensors': a call on cuda:1's
    tensors while cuda:0 is current (transformers' ``device_map`` spreads a model's layers over GPUs
    and leaves cuda:0 current) launched on cuda:0 with cuda:1's pointers. The launcher makes the
    call's device current around its launches (``kernels._device_guard``, torch's device context
    stubbed here: no GPU), and nothing where it is current already or the tensors are not CUDA's."""
    from xlnet_fast import kernels

    entered = []

    class DeviceContext:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(("enter", self.index))

        def __exit__(self, *exc):
            entered.append(("exit", self.index))

    monkeypatch.setattr(kernels, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", DeviceContext)
    with kernels._device_guard(torch.device("cuda", 1)):
        entered.append("launch")
    assert entered == [("enter", 1), "launch", ("exit", 1)]
    for device in (torch.device("cuda", 0), "cuda:0", torch.device("cpu"), torch.device("meta")):
        with kernels._device_guard(device):
            pass
    assert entered == [("enter", 1), "launch", ("exit", 1)]


def test_every_launch_of_a_call_runs_under_its_device_guard(monkeypatch):
    """The tables, the forward's and the backward's launches each run inside ``_device_guard`` of
    the call's device (a launch outside it would go to whichever GPU is current)."""
    from xlnet_fast import kernels

    guarded, launched = [], []

    @contextlib.contextmanager
    def guard(device):
        guarded.append(torch.device(device))
        launched.append("guard on")
        yield
        launched.append("guard off")

    def run(role, grid, plan, tensors, deterministic, config=None):
        launched.append(role)
        return kernels._k.INTERPRETER_TILES

    def table_launch(name, grid, tensors, scalars):
        launched.append(name)

    monkeypatch.setattr(kernels, "_device_guard", guard)
    monkeypatch.setattr(kernels, "_run", run)
    monkeypatch.setattr(kernels, "_launch_table_kernel", table_launch)
    call, leaves, upstream = layer_call()  # the tables: prepared here
    torch.autograd.grad(call(), leaves, upstream)
    assert guarded == [torch.device("cpu")] * 3  # the tables, the forward, the backward
    # every launch between a guard's entry and its exit
    depth = 0
    for event in launched:
        depth += {"guard on": 1, "guard off": -1}.get(event, 0)
        assert depth == 1 or event == "guard off", launched
    assert launched.count("guard on") == 3 and "_tables_kernel" in launched and "dq" in launched


def test_prepared_masks_build_nothing_per_call(gpu_like):
    """Every table the kernels read comes prepared: a call makes no PyTorch op on the masks (the
    tables' build was 41 small kernels per layer, forward and again backward)."""
    from bench.host_cost import _CountOps

    call, _, _ = layer_call()
    with torch.no_grad(), _CountOps() as ops:
        call()
    assert ops.ops == {"randint": 1}, ops.ops  # the dropout seed, drawn on the device


def test_preparing_two_stream_masks_takes_three_kernel_launches_and_ten_ops(monkeypatch):
    """The tables of pretraining's masks (both streams, ranks, segments, padding targets), built once per
    forward and by every call given raw masks: three launches of the tables' kernels
    (``kernels/tables.py``) and ten PyTorch ops that would each be a GPU launch (the two streams'
    masks joined, the positions checked on the device). In PyTorch the tables took 75 such ops (84,
    then 65, then 75 with the leading keys seen whole: bench/NOTES.md), ~20-40 us each on an H100's
    host, more than the forward kernel's time at small shapes."""
    from bench.host_cost import _CountOps
    from xlnet_fast import kernels

    g = torch.Generator().manual_seed(0)
    K = MLEN + L
    raw = dict(target_pos=torch.randint(-1, L, (B, P), generator=g), q_seg=torch.randint(0, 2, (B, L), generator=g),
               k_seg=torch.randint(0, 2, (B, K), generator=g),
               q_rank=torch.randint(0, L, (B, L), generator=g, dtype=torch.int32),
               k_rank=torch.randint(0, L, (B, K), generator=g, dtype=torch.int32))
    xlnet_fast.prepare_two_stream_masks(B, L, K, device="cpu", backend="triton", **raw)  # ORDERS made per device
    launched = []
    monkeypatch.setattr(kernels, "_launch_table_kernel", lambda name, *args: launched.append(name))
    with _CountOps() as ops:
        masks = xlnet_fast.prepare_two_stream_masks(B, L, K, device="cpu", backend="triton", **raw)
    assert masks.rows_table is not None
    assert launched == ["_first_ids_kernel", "_tables_kernel", "_row_groups_kernel"]
    assert sum(ops.ops.values()) <= 10, ops.ops


def pretraining_step(n_layer: int):
    """(model, keyword inputs) of XLNet's pretraining step on the Triton path: ranks, target positions,
    segments, memory, labels, dropout."""
    c = XLNetConfig(**{**SMALL, "n_layer": n_layer, "dropout": 0.1, "mem_len": MLEN}, attn_backend="triton")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, c.vocab_size, (B, L), generator=g)
    q_rank = torch.randint(0, L, (B, L), generator=g, dtype=torch.int32)
    target_pos = torch.randint(0, L, (B, P), generator=g)
    mems = [torch.randn(MLEN, B, c.d_model) for _ in range(n_layer)]
    return XLNetLMHeadModel(c).train(), dict(
        input_ids=ids, q_rank=q_rank, k_rank=q_rank, target_pos=target_pos, token_type_ids=torch.zeros_like(ids),
        mems=mems, labels=ids.gather(1, target_pos), use_mems=True)


@pytest.mark.parametrize("n_layer", [1, 3])
def test_no_host_sync_in_a_pretraining_step(gpu_like, n_layer):
    """XLNet's pretraining forward and backward on the Triton path (ranks, target positions,
    segments, memory, labels, dropout) read no tensor on the host: not per layer (the op's position
    check, its dropout seed, the tables' build), not per forward (the token id and target position
    checks are assertions on the device). A read is a sync on a GPU and breaks CUDA-graph capture."""
    model, inputs = pretraining_step(n_layer)
    with host_reads() as reads:
        model(**inputs).loss.backward()
    assert reads == []
    assert gpu_like.count("fwd") == n_layer  # one launch per layer for both streams


def _pretraining_step_ops(n_layer: int) -> tuple[dict, dict]:
    """The PyTorch ops (``bench.host_cost``'s count: those that would run a GPU kernel) of a
    pretraining forward, and of its backward, on the Triton path with its launches counted."""
    from bench.host_cost import _CountOps

    model, inputs = pretraining_step(n_layer)
    with _CountOps() as forward:
        out = model(**inputs)
    with _CountOps() as backward:
        out.loss.backward()
    return forward.ops, backward.ops


def test_a_pretraining_layer_runs_both_streams_rows_through_one_feed_forward(gpu_like):
    """Both streams' rows go through a layer's query and output projections, its two layer norms and
    its feed-forward together (row-wise: the same values), not stream by stream: per layer 2 layer
    norms, 2 linear layers and 4 projections forward (k and v in one, k_r, q, o), and 50 PyTorch ops forward
    and backward in all (CPU's unfused dropout counted), where stream by stream made 96: each op
    twice, and each weight's gradient summed over the streams. On a GPU's host each is a launch (~40 us
    on the H100: bench/NOTES.md)."""
    one, three = _pretraining_step_ops(1), _pretraining_step_ops(3)
    per_layer = {name: (three[0].get(name, 0) - one[0].get(name, 0)) / 2 for name in set(three[0]) | set(one[0])}
    assert per_layer["native_layer_norm"] == 2 and per_layer["addmm"] == 2 and per_layer["mm"] == 4, per_layer
    total = sum(three[0].values()) + sum(three[1].values()) - sum(one[0].values()) - sum(one[1].values())
    assert total / 2 <= 60, (three, one)


def test_under_autocast_the_relative_positions_are_cast_once_per_forward(monkeypatch):
    """Every layer's k_r product takes pos_emb in the autocast dtype: the backbone casts it once (one
    launch per forward, not one per layer), and the loss and gradients are those of autocast casting
    it in every layer, bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from xlnet_fast.model import backbone

    class PositionCasts(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.count = shape, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket.__name__ == "_to_copy" and tuple(args[0].shape) == self.shape
            return func(*args, **(kwargs or {}))

    model, inputs = pretraining_step(2)
    model.config.attn_backend = "eager"  # the layers' code is the backends' (and the interpreter is slow)
    pos_shape = (1, MLEN + 2 * L, model.config.d_model)  # (Br, klen + qlen, d): relative positions

    def step():
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        return loss, torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)

    with PositionCasts(pos_shape) as casts:
        loss, grads = step()
    assert casts.count == 1
    monkeypatch.setattr(backbone, "product_dtype", lambda weight: weight.dtype)  # autocast casts it per layer
    with PositionCasts(pos_shape) as casts:
        expected_loss, expected = step()
    assert casts.count == 2  # the check above counts the right tensor
    assert torch.equal(loss, expected_loss)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, expected))


@pytest.mark.parametrize("backend", ["triton", "eager"])
def test_a_training_step_with_dropout_compiles_to_one_graph(backend):
    """``torch.compile(model, fullgraph=True)`` traces XLNet's pretraining forward (two streams, ranks,
    segments, memory, dropout) and its backward as one graph each: no host read breaks it (the op
    is opaque to the compiler, with a fake for shapes), and the compiled step matches the eager
    one with dropout off."""
    c = XLNetConfig(**{**SMALL, "dropout": 0.1, "mem_len": MLEN}, attn_backend=backend)
    model = XLNetLMHeadModel(c).train()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, c.vocab_size, (B, L), generator=g)
    q_rank = torch.randint(0, L, (B, L), generator=g, dtype=torch.int32)
    target_pos = torch.randint(0, L, (B, P), generator=g)
    inputs = dict(q_rank=q_rank, k_rank=q_rank, target_pos=target_pos, token_type_ids=torch.zeros_like(ids),
                  mems=[torch.randn(MLEN, B, c.d_model, generator=g) for _ in range(c.n_layer)],
                  labels=ids.gather(1, target_pos), use_mems=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(ids, **inputs).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()  # no dropout: the same numbers as eager
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, **inputs).loss, model(ids, **inputs).loss)


def test_the_patched_transformers_model_compiles():
    """A drop-in user's ``torch.compile`` of a patched transformers model (dense ``perm_mask`` and
    one-hot ``target_mapping``) runs and gives eager's loss and gradients: the read of whether the
    mapping is one-hot breaks the graph there, it does not fail."""
    from helpers.models import hf_model, token_ids

    model = xlnet_fast.patch_transformers(hf_model("XLNetLMHeadModel", seed=4))
    ids = token_ids(B, L, seed=5)
    g = torch.Generator().manual_seed(6)
    perm_mask = (torch.rand(B, L, L, generator=g) < 0.5).float()
    target_mapping = torch.zeros(B, P, L).scatter_(2, torch.randperm(L, generator=g)[:P].expand(B, P)[..., None], 1.0)
    inputs = dict(perm_mask=perm_mask, target_mapping=target_mapping, labels=ids[:, :P].contiguous())
    eager = model(ids, **inputs).loss
    eager_grads = torch.autograd.grad(eager, list(model.parameters()), allow_unused=True)
    compiled = torch.compile(model, backend="aot_eager")(ids, **inputs).loss
    compiled_grads = torch.autograd.grad(compiled, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_grads, eager_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("blocked", [False, True])
def test_the_patched_model_averages_rows_that_see_no_key_only_when_there_are_some(monkeypatch, blocked):
    """transformers gives a query-stream row that sees no key the mean of v (its -1e30 mask swamps the
    scores); the patched model does the same in every layer (a mean and a select, forward and
    backward), but only when a target row sees no key: the forward's one host read, that of whether
    the target mapping is one-hot, answers that too. With such a row the loss is transformers'."""
    from bench.host_cost import _CountOps
    from helpers.models import hf_model, token_ids

    ids = token_ids(B, L, seed=5)
    g = torch.Generator().manual_seed(6)
    perm_mask = (torch.rand(B, L, L, generator=g) < 0.5).float()
    targets = torch.randperm(L, generator=g)[:P]
    if blocked:
        perm_mask[0, targets[0]] = 1.0  # the first target row of batch row 0 sees no key (no memory)
    target_mapping = torch.zeros(B, P, L).scatter_(2, targets.expand(B, P)[..., None], 1.0)
    inputs = dict(perm_mask=perm_mask, target_mapping=target_mapping, labels=ids[:, :P].contiguous())
    expected = hf_model("XLNetLMHeadModel", seed=4)(ids, **inputs).loss
    model = xlnet_fast.patch_transformers(hf_model("XLNetLMHeadModel", seed=4))
    monkeypatch.setattr(op_args, "host_value_checks", lambda device: False)  # checks of values as on a GPU
    with host_reads() as reads, _CountOps() as ops:
        loss = model(ids, **inputs).loss
    assert len(reads) == 1, reads  # whether the mapping is one-hot, and whether a target row sees no key
    assert ops.ops.get("mean", 0) == (model.config.n_layer if blocked else 0), ops.ops
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("div_val", [1, 2])
def test_transfo_xl_training_step_reads_the_host_once_per_adaptive_layer(gpu_like, div_val):
    """Transformer-XL's pretraining step (``pretrain.causal.CausalLMLoss``: memory, dropout, the
    adaptive softmax's loss) on the Triton path: the attention reads nothing on the host; the
    adaptive softmax reads its clusters' sizes once per call (it scores each target's own cluster
    only: the sizes shape the gathers), as does the adaptive input when its clusters have their own
    tables (``div_val`` > 1). The original code and transformers 4.x read once per cluster."""
    from xlnet_fast import TransfoXLConfig, TransfoXLLMHeadModel
    from xlnet_fast.pretrain.causal import CausalLMLoss

    c = TransfoXLConfig(vocab_size=60, cutoffs=[15, 35], d_model=32, d_embed=32, n_head=H, d_head=D, d_inner=48,
                        n_layer=2, div_val=div_val, mem_len=MLEN, dropout=0.1, dropatt=0.1, attn_backend="triton")
    step = CausalLMLoss(TransfoXLLMHeadModel(c).train())
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 60, (B, L + 1), generator=g)
    mems = [torch.randn(MLEN, B, 32, generator=g) for _ in range(2)]
    with host_reads() as reads:
        total, count, new_mems = step(ids[:, :-1], ids[:, 1:], mems)
        total.backward()
    assert reads == ["tolist"] * (1 if div_val == 1 else 2), reads
    assert gpu_like.count("fwd") == 2 and len(new_mems) == 2
