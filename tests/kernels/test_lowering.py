"""Every Triton kernel, and the SSD's Mosaic GPU kernels, lower for CUDA (checked on CPU,
without a GPU).

Interpret mode does not enforce Triton's rules (power-of-two blocks, supported
primitives); lowering for CUDA does. ptxas does not run here: shared-memory overflow and
spills show only on the GPU (tools/gpu_check.sh).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import chunk_metadata, max_chunks_for
from pallas_kernels.mamba_decode import triton as mamba_decode_triton
from pallas_kernels.mamba_decode import triton_config as mamba_decode_config
from pallas_kernels.ssd import mosaic as ssd_mosaic
from pallas_kernels.ssd import mosaic_config as ssd_mosaic_config
from pallas_kernels.ssd import triton as ssd_triton
from pallas_kernels.ssd import triton_config as ssd_config
from pallas_kernels.state_update import triton as state_update_triton
from pallas_kernels.state_update import triton_config as state_update_config
from tests.helpers import lower_for_cuda, primitives_outside_kernels, spec


@pytest.mark.parametrize(
    ("head_dim", "state_dim", "chunk_size", "intermediate", "dtype"),
    [
        (64, 128, 256, False, jnp.bfloat16),
        (80, 256, 128, True, jnp.float32),
        (4, 8, 8, False, jnp.float32),
    ],
)
def test_internal_ssd_lowers(head_dim, state_dim, chunk_size, intermediate, dtype):
    text = _lower_ssd(
        ssd_triton.ssd_scan,
        head_dim=head_dim,
        state_dim=state_dim,
        chunk_size=chunk_size,
        dtype=dtype,
        return_intermediate_states=intermediate,
        config=ssd_config.default_block_sizes(chunk_size, head_dim, state_dim),
    )
    for name in ("ssd_state_scan", "ssd_chunk_cb", "ssd_chunk_scan"):
        assert name in text


@pytest.mark.parametrize(
    ("chunk_size", "gated", "intermediate"),
    [(256, True, False), (128, False, False), (256, False, True)],
)
def test_internal_ssd_mosaic_lowers(chunk_size, gated, intermediate):
    """The Mosaic GPU kernels lower (layouts, transforms, barriers): chunk 256 with D, z
    and initial states (two blocks per chunk, two state-scan steps per chunk), chunk 128
    without them: the state scan and the chunk scan are the two Mosaic kernels and no
    Triton kernel runs; with intermediate states the Triton state scan runs instead."""
    text = _lower_ssd(
        ssd_mosaic.ssd_scan,
        chunk_size=chunk_size,
        gated=gated,
        initial=gated,
        return_intermediate_states=intermediate,
        config=ssd_mosaic_config.BlockSizes(),
    )
    assert text.count("custom_call @mosaic_gpu") == (1 if intermediate else 2)
    assert ("ssd_state_scan" in text) == intermediate
    assert "ssd_chunk_scan" not in text and "ssd_chunk_cb" not in text


def test_internal_ssd_mosaic_calls_share_one_compiled_scan():
    """Calls with equal options reuse the scan that ``triton._differentiable`` caches for
    them: the Mosaic stages it is keyed by are one object per config, not one per call."""
    options = dict(chunk_size=128, return_intermediate_states=False)
    _lower_ssd(ssd_mosaic.ssd_scan, config=ssd_mosaic_config.BlockSizes(), **options)
    cached = ssd_triton._differentiable.cache_info().currsize
    _lower_ssd(ssd_mosaic.ssd_scan, config=ssd_mosaic_config.BlockSizes(), **options)
    assert ssd_triton._differentiable.cache_info().currsize == cached


def _lower_ssd(
    scan,
    *,
    chunk_size: int,
    head_dim: int = 64,
    state_dim: int = 128,
    dtype=jnp.bfloat16,
    gated: bool = True,
    initial: bool = True,
    **options,
) -> str:
    """``scan`` (a backend's ``ssd_scan``) lowered for CUDA on a 3-sequence batch of 512
    tokens, 8 heads in 2 groups; D and z with ``gated``, initial states with ``initial``."""
    T, H, G, num_seqs = 512, 8, 2, 3

    def fn(x, dt, A, B, C, D, z, dt_bias, init, qsl, computed):
        md = chunk_metadata(
            qsl, computed, chunk_size=chunk_size, max_chunks=max_chunks_for(T, num_seqs, chunk_size)
        )
        return scan(
            x,
            dt,
            A,
            B,
            C,
            metadata=md,
            chunk_size=chunk_size,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_softplus=True,
            dt_limit=(0.0, math.inf),
            initial_states=init,
            state_dtype=jnp.float32,
            **options,
        )

    return lower_for_cuda(
        fn,
        spec((T, H, head_dim), dtype),
        spec((T, H), dtype),
        spec((H,), jnp.float32),
        spec((T, G, state_dim), dtype),
        spec((T, G, state_dim), dtype),
        spec((H, head_dim), jnp.float32) if gated else None,
        spec((T, H, head_dim), dtype) if gated else None,
        spec((H,), jnp.float32),
        spec((num_seqs, H, head_dim, state_dim), jnp.float32) if initial else None,
        spec((num_seqs + 1,), jnp.int32),
        spec((num_seqs,), jnp.int32),
    )


@pytest.mark.parametrize(
    "cache_dtype, R", [(jnp.float32, 4), (jnp.bfloat16, 4), (jnp.float32, 256)]
)
def test_internal_state_update_lowers(cache_dtype, R):
    """One head per program, and (256 rows) 4 heads per program unrolled.
    ``D[H]`` reaches the kernel as it is (a scalar per head): no ``[H, P]`` broadcast before
    the custom call, which was one more launch per decode step of every Mamba layer."""
    S, H, P, N, G = 8, 128, 64, 128, 2

    def fn(cache, x, dt, A, B, C, slots, D):
        return state_update_triton.selective_state_update(
            cache,
            x,
            dt,
            A,
            B,
            C,
            slot_ids=slots,
            D=D,
            z=x,
            dt_bias=None,
            dt_softplus=True,
            dt_limit=(0.0, math.inf),
            config=config,
        )

    config = state_update_config.default_block_sizes(P, N, rows=R, num_heads=H)
    assert (config.block_h, config.unroll_heads) == ((4, True) if R == 256 else (1, False))

    text = lower_for_cuda(
        fn,
        spec((S, H, P, N), cache_dtype),
        spec((R, H, P)),
        spec((R, H)),
        spec((H,), jnp.float32),
        spec((R, G, N)),
        spec((R, G, N)),
        spec((R,), jnp.int32),
        spec((H,), jnp.float32),
    )
    unrolled = "_unrolled" if config.unroll_heads else ""
    assert f"selective_state_update_bp{config.block_p}_bh{config.block_h}{unrolled}" in text
    assert f"tensor<{H}x{P}xf32>" not in text, "D was broadcast to [H, P]"


@pytest.mark.parametrize("norm, gate", [(True, True), (False, True), (False, False)])
def test_internal_mamba2_decode_lowers_on_packed_rows(norm, gate):
    """Bamba-9B's decode mixer lowers as the conv update, the state update and (with the
    norm) the gated norm, and nothing outside the kernels slices in_proj's rows or the conv
    output: each such slice was an XLA copy kernel a layer before the kernels read the
    packed rows. Without the norm the state update is gated by z, or ungated."""
    S, H, P, N, G, K, R = 8, 128, 64, 128, 1, 4, 64
    conv_dim = H * P + 2 * G * N

    def fn(zxbcdt, conv_cache, conv_weight, ssm_cache, A_log, slots, D, dt_bias, norm_weight):
        return mamba_decode_triton.mamba2_decode(
            zxbcdt,
            conv_cache,
            conv_weight,
            None,
            ssm_cache,
            A_log,
            num_groups=G,
            slot_ids=slots,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=True,
            dt_limit=(0.0, math.inf),
            norm_weight=norm_weight if norm else None,
            norm_group_size=H * P // G,
            norm_eps=1e-5,
            norm_before_gate=False,
            gate=gate,
            config=mamba_decode_config.default_block_sizes(
                rows=R,
                conv_dim=conv_dim,
                state_shape=(H, P, N),
                norm_group_size=H * P // G,
                gated=not norm and gate,
            ),
        )

    args = (
        spec((R, H * P + conv_dim + H)),
        spec((S, K - 1, conv_dim)),
        spec((conv_dim, K)),
        spec((S, H, P, N), jnp.float32),
        spec((H,), jnp.float32),
        spec((R,), jnp.int32),
        spec((H,), jnp.float32),
        spec((H,), jnp.float32),
        spec((H * P,)),
    )
    text = lower_for_cuda(fn, *args)
    # The kernels' names as their custom calls carry them: a kernel's serialized Triton IR
    # also holds source names (a Python frame of whatever traced it first), so a bare
    # substring could be found in another kernel's IR.
    launched = re.findall(r'name = "([^"]+)"', text)

    def launches(kernel: str) -> bool:
        return any(name.startswith(kernel) for name in launched)

    assert launches("causal_conv1d_update_k4") and launches("selective_state_update_bp"), launched
    assert launches("gated_rms_norm") == norm, launched
    outside = primitives_outside_kernels(jax.make_jaxpr(fn)(*args).jaxpr)
    assert not outside & {"slice", "dynamic_slice", "gather", "concatenate"}, outside
