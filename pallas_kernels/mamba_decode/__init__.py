"""The Mamba2 mixer's decode step on in_proj's packed output: conv update, state update
and gated norm."""

from pallas_kernels.mamba_decode.api import mamba2_decode

__all__ = ["mamba2_decode"]
