"""Gated grouped RMSNorm (the Mamba2 mixer's output norm)."""

from pallas_kernels.norm.api import gated_rms_norm

__all__ = ["gated_rms_norm"]
