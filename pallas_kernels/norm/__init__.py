"""Gated grouped RMSNorm (the Mamba2 mixer's output norm) and RMSNorm with the residual add
(the blocks' pre-norms)."""

from pallas_kernels.norm.api import gated_rms_norm, rms_norm

__all__ = ["gated_rms_norm", "rms_norm"]
