"""Argument checks the fused Mamba2 mixer ops (``mamba2_prefill``, ``mamba2_decode``)
share: both take in_proj's packed rows, the conv and SSM caches and the mixer's
parameters, and check them here, once."""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels import _validation as checks
from pallas_kernels.conv1d.api import check_weights_and_cache


@dataclasses.dataclass(frozen=True)
class PackedMixer:
    """Static facts of a Mamba2 mixer call on in_proj's packed rows, checked."""

    num_slots: int  # S, the caches' slots
    d_inner: int  # H P
    num_groups: int  # G
    dt_limit: tuple[float, float]
    norm_group_size: int


def check_packed_mixer(
    zxbcdt: jax.Array,
    conv_state_cache: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    ssm_state_cache: jax.Array,
    A_log: jax.Array,
    *,
    D: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_limit: tuple[float, float],
    norm_weight: jax.Array | None,
    norm_group_size: int | None,
    norm_eps: float,
    rows: str,
) -> PackedMixer:
    """The checks ``mamba2_decode`` and ``mamba2_prefill`` share: the caches, the conv
    weight (which gives G), ``zxbcdt[rows, 2 H P + 2 G N + H]``, the SSM's parameters
    (``A_log[H]`` among them) and the norm's (``rows``: the row axis' letter in messages).
    Raises ``ValueError`` naming the argument."""
    checks.check_floating("ssm_state_cache", ssm_state_cache)
    if ssm_state_cache.ndim != 4:
        raise ValueError(
            f"ssm_state_cache must have shape [S, H, P, N], got {ssm_state_cache.shape}"
        )
    S, H, P, N = ssm_state_cache.shape
    d_inner = H * P
    if conv_weight.ndim != 2:
        raise ValueError(f"conv_weight must have shape [conv_dim, K], got {conv_weight.shape}")
    conv_dim = conv_weight.shape[0]
    gn2 = conv_dim - d_inner
    if gn2 <= 0 or gn2 % (2 * N) or H % (gn2 // (2 * N)):
        raise ValueError(
            f"conv_weight must have shape [conv_dim, K] with conv_dim = H P + 2 G N "
            f"(H={H}, P={P}, N={N}, G dividing H), got {conv_weight.shape}"
        )
    G = gn2 // (2 * N)
    if check_weights_and_cache(conv_weight, conv_bias, conv_state_cache, conv_dim) != S:
        raise ValueError(
            f"conv_state_cache and ssm_state_cache must have the same slots S, got "
            f"{conv_state_cache.shape[0]} and {S}"
        )
    checks.check_floating("zxbcdt", zxbcdt)
    width = d_inner + conv_dim + H
    if zxbcdt.ndim != 2 or zxbcdt.shape[1] != width:
        raise ValueError(
            f"zxbcdt must have shape [{rows}, 2 H P + 2 G N + H] = ({rows}, {width}), "
            f"got {zxbcdt.shape}"
        )
    num_rows = zxbcdt.shape[0]

    def split(*shape: int) -> jax.ShapeDtypeStruct:
        """A piece of the split row, for the SSM's own checks (A_log, D, dt_bias, dt_limit)."""
        return jax.ShapeDtypeStruct(shape, zxbcdt.dtype)

    dt_limit = checks.check_ssm_inputs(
        split(num_rows, H, P), split(num_rows, H), A_log, split(num_rows, G, N),
        split(num_rows, G, N), D=D, z=None, dt_bias=dt_bias, dt_limit=dt_limit, rows=rows,
        A_name="A_log",
    )  # fmt: skip
    if norm_group_size is None:
        norm_group_size = d_inner // G
    if norm_weight is not None:
        checks.check_shape("norm_weight", norm_weight, (d_inner,), "[d_inner]")
        if norm_group_size < 1 or d_inner % norm_group_size:
            raise ValueError(f"{norm_group_size=} must be >= 1 and divide d_inner={d_inner}")
        checks.check_float("norm_eps", norm_eps, low=0.0)
    return PackedMixer(S, d_inner, G, dt_limit, int(norm_group_size))
