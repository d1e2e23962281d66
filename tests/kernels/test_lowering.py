"""Every Triton kernel lowers for CUDA (checked on CPU, without a GPU).

Interpret mode does not enforce Triton's rules (power-of-two blocks, supported
primitives); lowering for CUDA does. ptxas does not run here: shared-memory overflow and
spills show only on the GPU (tools/gpu_check.sh).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest

from pallas_kernels import chunk_metadata, max_chunks_for
from pallas_kernels.ssd import triton as ssd_triton
from pallas_kernels.state_update import triton as state_update_triton
from tests.helpers import lower_for_cuda, spec


@pytest.mark.parametrize(
    ("head_dim", "state_dim", "chunk_size", "intermediate", "dtype"),
    [
        (64, 128, 256, False, jnp.bfloat16),
        (80, 256, 128, True, jnp.float32),
        (4, 8, 8, False, jnp.float32),
    ],
)
def test_ssd_lowers(head_dim, state_dim, chunk_size, intermediate, dtype):
    T, H, G, num_seqs = 512, 8, 2, 3

    def fn(x, dt, A, B, C, D, z, dt_bias, init, qsl, computed):
        md = chunk_metadata(
            qsl, computed, chunk_size=chunk_size, max_chunks=max_chunks_for(T, num_seqs, chunk_size)
        )
        return ssd_triton.ssd_scan(
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
            return_intermediate_states=intermediate,
            state_dtype=jnp.float32,
            config=ssd_triton.default_block_sizes(chunk_size, head_dim, state_dim),
        )

    text = lower_for_cuda(
        fn,
        spec((T, H, head_dim), dtype),
        spec((T, H), dtype),
        spec((H,), jnp.float32),
        spec((T, G, state_dim), dtype),
        spec((T, G, state_dim), dtype),
        spec((H, head_dim), jnp.float32),
        spec((T, H, head_dim), dtype),
        spec((H,), jnp.float32),
        spec((num_seqs, H, head_dim, state_dim), jnp.float32),
        spec((num_seqs + 1,), jnp.int32),
        spec((num_seqs,), jnp.int32),
    )
    for name in ("ssd_state_scan", "ssd_chunk_cb", "ssd_chunk_scan"):
        assert name in text


@pytest.mark.parametrize(
    "cache_dtype, R", [(jnp.float32, 4), (jnp.bfloat16, 4), (jnp.float32, 256)]
)
def test_state_update_lowers(cache_dtype, R):
    """One head per program, and (256 rows) 16 heads per program in a pipelined loop."""
    S, H, P, N, G = 8, 128, 64, 128, 2

    def fn(cache, x, dt, A, B, C, slots):
        return state_update_triton.selective_state_update(
            cache,
            x,
            dt,
            A,
            B,
            C,
            slot_ids=slots,
            D=None,
            z=x,
            dt_bias=None,
            dt_softplus=True,
            dt_limit=(0.0, math.inf),
            config=config,
        )

    config = state_update_triton.default_block_sizes(P, N, rows=R, num_heads=H)
    assert config.block_h == (16 if R == 256 else 1)

    text = lower_for_cuda(
        fn,
        spec((S, H, P, N), cache_dtype),
        spec((R, H, P)),
        spec((R, H)),
        spec((H,), jnp.float32),
        spec((R, G, N)),
        spec((R, G, N)),
        spec((R,), jnp.int32),
    )
    assert f"selective_state_update_bp64_bh{config.block_h}" in text
