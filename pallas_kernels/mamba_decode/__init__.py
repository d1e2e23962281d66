"""The Mamba2 mixer's decode step between its two projections, fused: conv update, SSM
state update and gate in one kernel."""

from pallas_kernels.mamba_decode.api import mamba2_decode

__all__ = ["mamba2_decode"]
