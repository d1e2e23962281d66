"""The Mamba2 mixer's prefill on in_proj's packed output: causal conv, SSD scan and gated
norm."""

from pallas_kernels.mamba_prefill.api import mamba2_prefill

__all__ = ["mamba2_prefill"]
