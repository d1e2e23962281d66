"""Tiling sweeps: candidate block sizes of a kernel timed on the benchmark problems.

``python -m benchmarks.tune.attention`` (the Triton masked-tail attention kernels) and
``python -m benchmarks.tune.conv1d`` (the Triton conv1d and gated-norm kernels), on a GPU.
Sweep drivers only: the defaults they inform live in each kernel's ``default_block_sizes``.
"""
