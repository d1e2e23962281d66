"""Sum over a mesh axis inside ``shard_map``: ``lax.psum`` or a one-shot Mosaic GPU kernel."""

from pallas_kernels.all_reduce.api import all_reduce

__all__ = ["all_reduce"]
