"""Attention over a slot-indexed KV cache that skips fully masked KV tails."""

from pallas_kernels.attention.api import kv_lens_from_mask, masked_tail_attention, write_kv

__all__ = ["kv_lens_from_mask", "masked_tail_attention", "write_kv"]
