"""Compiling ahead (``bench.compiler.precompile``) against triton's JIT, on a fake GPU.

Run in a process of its own, with the kernels compiled (``TRITON_INTERPRET`` unset) and
``TRITON_CACHE_DIR`` an empty folder: ``python tests/helpers/precompile_check.py ARCH`` compiles
ahead what one forward and backward of the op (raw masks: the table kernels too) will launch, each
kernel's candidates cut to its first (a short test; both sides see the same list), then makes that
call through triton's real JIT on a fake ``sm_<ARCH>`` (``bench.compiler.fake_gpu``), and prints one
JSON line: what was compiled ahead, the binaries the JIT launched ({cache folder: kernel}), and the
cache folders the JIT added (none when each of its compiles found the binary compiled ahead).
"""

from __future__ import annotations

import base64
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(arch: int) -> int:
    sys.path.insert(0, ROOT)
    import torch

    from bench import attention, cases
    from bench.compiler.fake_gpu import fake_gpu, triton_backend_on
    from bench.compiler.precompile import compile_ahead
    from bench.source_tree import ensure_kernels_importable

    ensure_kernels_importable()
    from xlnet_fast.kernels import rel_attention

    candidates = rel_attention.configs_for
    rel_attention.configs_for = lambda arch, head_dim, role: candidates(arch, head_dim, role)[:1]

    case = cases.AttentionCase(B=2, H=2, qlen=64, mlen=16, D=64, dtype=torch.bfloat16)

    def call(device):
        return lambda: attention.provider_fn("xlnet_fast", cases.attention_inputs(case, device), "fwd_bwd")()

    cache = os.environ["TRITON_CACHE_DIR"]
    with fake_gpu(arch) as gpu:
        ahead = compile_ahead([("xlnet_fast fwd_bwd", call("meta"))], arch, jobs=2)
        compiled = set(os.listdir(cache))
        with triton_backend_on("cpu"):
            call("cpu")()
    # triton names a binary's cache folder by its hash in base 32
    launched = {base64.b32encode(bytes.fromhex(launch.binary)).decode().rstrip("="): launch.kernel
                for launch in gpu.launches}
    print(json.dumps({**ahead, "cache_folders": len(compiled), "launches": len(gpu.launches), "launched": launched,
                      "launched_not_compiled_ahead": sorted(set(launched) - compiled),
                      "added_by_the_jit": sorted(set(os.listdir(cache)) - compiled)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
