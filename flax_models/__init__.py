"""Flax NNX hybrid Mamba2/attention models built on ``pallas_kernels``."""
