"""Chunk-aligned SSD scan (Mamba2 prefill over variable-length batches)."""

from pallas_kernels.ssd.api import ssd_scan

__all__ = ["ssd_scan"]
