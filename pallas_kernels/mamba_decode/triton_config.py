"""Configuration of the fused Mamba2 decode step (``mamba_decode/triton.py``): its block
sizes (each of its three kernels' own) and the heuristic that picks them."""

from __future__ import annotations

import dataclasses

from pallas_kernels.conv1d import triton_config as conv
from pallas_kernels.norm import triton_config as norm
from pallas_kernels.state_update import triton_config as state_update


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the decode step: each of its three kernels' own block sizes (their
    fields are checked by those types)."""

    conv: conv.BlockSizes = dataclasses.field(default_factory=conv.BlockSizes)
    state_update: state_update.BlockSizes = dataclasses.field(
        default_factory=state_update.BlockSizes
    )
    norm: norm.BlockSizes = dataclasses.field(default_factory=norm.BlockSizes)

    def __post_init__(self):
        for name, kind in (
            ("conv", conv.BlockSizes),
            ("state_update", state_update.BlockSizes),
            ("norm", norm.BlockSizes),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ValueError(
                    f"{name}={value!r} must be a {kind.__module__}.{kind.__qualname__}"
                )


def default_block_sizes(
    *,
    rows: int,
    conv_dim: int,
    state_shape: tuple[int, int, int],
    norm_group_size: int,
    gated: bool,
) -> BlockSizes:
    """Each kernel's own heuristic for its part of the step: ``rows`` decode rows, the
    conv's ``conv_dim`` channels, the state's ``(H, P, N)``; ``gated``: the state update
    applies the z gate itself (no norm), which has a tiling of its own."""
    H, P, N = state_shape
    return BlockSizes(
        conv=conv.default_update_block_sizes(conv_dim),
        state_update=state_update.default_block_sizes(P, N, rows=rows, num_heads=H, gated=gated),
        norm=norm.default_block_sizes(norm_group_size),
    )
