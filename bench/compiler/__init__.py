"""Compiler tooling: the fused kernels' machine code for every NVIDIA architecture without a GPU
(behind ``python -m bench.compile_report``), and the op's autotuned configs.

- ``aot``: capture the Triton launches of launch code, compile them ahead of time for an arch;
- ``sass``: read SASS: basic blocks, natural loops, the key loop, instructions by class;
- ``fa2_reference``: the plain FlashAttention-2 kernel the op's binaries are counted against;
- ``launches``: the report's scenarios, their launches per arch, each binary compiled and analysed;
- ``targets``: the targets, like-for-like ratios, the summary per kernel and the regression gate;
- ``pinned_configs``: the autotuners pinned to some configs, and the configs they chose.
"""
