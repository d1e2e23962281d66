"""Causal depthwise conv1d for packed prefill batches and for decode."""

from pallas_kernels.conv1d.api import causal_conv1d, causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update"]
