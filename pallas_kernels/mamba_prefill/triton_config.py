"""Configuration of the fused Mamba2 prefill (``mamba_prefill/triton.py``): its block
sizes (its conv's and norm's own), the heuristic that picks them and the check of a
given config."""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels.conv1d import triton_config as conv
from pallas_kernels.norm import triton_config as norm


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the prefill step: its conv's and norm's block sizes (the scan takes its
    own backend's heuristic). The conv's ``block_d`` must divide ``d_inner``: each conv
    program writes either x or ``B | C``."""

    conv: conv.BlockSizes = dataclasses.field(default_factory=conv.BlockSizes)
    norm: norm.BlockSizes = dataclasses.field(default_factory=norm.BlockSizes)

    def __post_init__(self):
        for name, kind in (("conv", conv.BlockSizes), ("norm", norm.BlockSizes)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ValueError(
                    f"{name}={value!r} must be a {kind.__module__}.{kind.__qualname__}"
                )


def default_block_sizes(
    conv_weight: jax.ShapeDtypeStruct, d_inner: int, norm_group_size: int
) -> BlockSizes:
    """The conv's and the norm's heuristics, the conv's channel block halved until it
    divides ``d_inner``."""
    conv_blocks = conv.default_block_sizes(*conv_weight.shape)
    block_d = conv_blocks.block_d
    while d_inner % block_d:
        block_d //= 2
    return BlockSizes(
        conv=dataclasses.replace(conv_blocks, block_d=block_d),
        norm=norm.default_block_sizes(norm_group_size),
    )


def check_block_sizes(config: BlockSizes, *, width: int, d_inner: int) -> None:
    """``ValueError`` when ``config`` cannot serve a conv of ``width`` taps over ``d_inner``
    channels of x."""
    conv.check_block_sizes(config.conv, width)
    if d_inner % config.conv.block_d:
        raise ValueError(
            f"conv.block_d={config.conv.block_d} must divide d_inner={d_inner} (each conv "
            f"program writes x or B | C)"
        )
