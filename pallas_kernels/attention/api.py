"""``masked_tail_attention``, ``write_kv``, ``kv_lens_from_mask``: validation and dispatch.

How a sequence's queries align with its keys (``kv_lens[b]`` counts this step's tokens;
bottom-right alignment, as FlashAttention's varlen causal mask)::

    kv_lens[b] = 7, q_len[b] = 3 (4 tokens cached, 3 new), causal:

               keys  0 1 2 3 4 5 6 | 7 ... L-1   (never loaded)
    query 0 (pos 4)  x x x x x . . |
    query 1 (pos 5)  x x x x x x . |
    query 2 (pos 6)  x x x x x x x |
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _validation as checks
from pallas_kernels.attention import kv_cache, mosaic, reference, triton
from pallas_kernels.attention._layout import jit_attention
from pallas_kernels.backend import Backend, Call, Implementation, Op


def _triton_default_config(q, k_cache, *_, **__) -> triton.BlockSizes:
    return triton.default_block_sizes(
        num_tokens=q.shape[0],
        num_q_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2],
        head_dim=q.shape[2],
        cache_len=k_cache.shape[1],
        dtype=q.dtype,
    )


def _mosaic_attention(
    q, k_cache, v_cache, *, causal, sm_scale, sliding_window, config: mosaic.BlockSizes, **batch
) -> jax.Array:
    """The Mosaic GPU kernel; its gradients run the Triton backward kernels (Pallas kernels
    too; the Mosaic kernel has no backward of its own), from the Triton query-block
    forward's saved logsumexp (under differentiation the forward runs that kernel)."""
    return jit_attention(
        triton.differentiable_attention,
        q,
        k_cache,
        v_cache,
        **batch,
        causal=causal,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        static=dict(
            block_sizes=_triton_default_config(q, k_cache),
            primal=mosaic.prefill_attention,
            primal_config=config,
        ),
    )


MASKED_TAIL_ATTENTION = Op(
    "masked_tail_attention",
    (
        Backend(
            "mosaic",
            _mosaic_attention,
            config_type=mosaic.BlockSizes,
            default_config=lambda *_, **__: mosaic.BlockSizes(),
            supports=mosaic.supports,
            check_config=lambda config, q, *_, **__: mosaic.check_block_sizes(
                config, num_q_heads=q.shape[1]
            ),
        ),
        Backend(
            "triton",
            triton.masked_tail_attention,
            config_type=triton.BlockSizes,
            default_config=_triton_default_config,
        ),
        Backend("xla", reference.masked_tail_attention),
    ),
)
WRITE_KV = Op("write_kv", (Backend("triton", triton.write_kv), Backend("xla", kv_cache.write_kv)))


def _check_cache(k_cache: jax.Array, v_cache: jax.Array) -> tuple[int, int, int, int]:
    checks.check_floating("k_cache", k_cache)
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must have shape [S, L, Hkv, D], got {k_cache.shape}")
    checks.check_shape("v_cache", v_cache, k_cache.shape, "[S, L, Hkv, D]")
    return k_cache.shape


def _check_batch(
    query_start_loc: jax.Array, kv_lens: jax.Array, slot_ids: jax.Array, num_slots: int
) -> jax.Array:
    """Static checks of the batch description; returns the checked slot ids."""
    for name, a in (("query_start_loc", query_start_loc), ("kv_lens", kv_lens)):
        checks.check_integer(name, a)
    if query_start_loc.ndim != 1 or query_start_loc.shape[0] < 2:
        raise ValueError(
            f"query_start_loc must have shape [B + 1] with B >= 1, got {query_start_loc.shape}"
        )
    num_seqs = query_start_loc.shape[0] - 1
    checks.check_shape("kv_lens", kv_lens, (num_seqs,), "[B]")
    return checks.check_slot_ids(slot_ids, num_seqs, num_slots, "[B]")


def _validate_batch(
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    *,
    num_tokens: int,
    num_slots: int,
    cache_len: int,
) -> None:
    qsl = checks.validate_query_start_loc(query_start_loc, num_tokens)
    checks.validate_slot_ids(slot_ids, num_slots)
    lens = checks.host_values("kv_lens", kv_lens)
    q_len = np.diff(qsl)
    if np.any(lens < q_len) or np.any(lens > cache_len):
        raise ValueError(
            f"kv_lens must satisfy q_len <= kv_lens <= L={cache_len}; "
            f"got kv_lens={lens.tolist()}, q_len={q_len.tolist()}"
        )


def masked_tail_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    causal: bool = True,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    validate: bool = False,
    implementation: Implementation = "auto",
    config: mosaic.BlockSizes | triton.BlockSizes | None = None,
) -> jax.Array:
    """Attention of packed queries over a slot-indexed KV cache, skipping masked KV tails.

    Query row ``i`` of sequence ``b`` sits at absolute position
    ``pos = kv_lens[b] - q_len[b] + i`` and sees keys ``j < kv_lens[b]``, ``j <= pos`` when
    ``causal``, and ``pos - W < j`` with ``sliding_window=W``. Keys at or past ``kv_lens[b]``
    are never read (the kernels never load those blocks). Query head ``h`` uses KV head
    ``h // (Hq // Hkv)``.

    Args:
      q: q[T, Hq, D] packed queries.
      k_cache: k_cache[S, L, Hkv, D].
      v_cache: v_cache[S, L, Hkv, D].
      query_start_loc: int32[B + 1].
      kv_lens: int32[B], valid keys per sequence including this step's tokens.
      slot_ids: int32[B], cache slot per sequence; ``-1`` (or any id outside ``[0, S)``)
        marks a padding sequence.
      causal: apply the causal mask (bottom-right aligned).
      sm_scale: logit scale, ``D ** -0.5`` by default.
      sliding_window: ``W`` keys visible per query (including itself), or None.
      validate: check ``query_start_loc``, ``kv_lens`` and ``slot_ids`` on the host.
      implementation: "auto" | "xla" | "triton" | "mosaic", or a sequence of backend names
        to take the first that serves the call (see ``pallas_kernels.backend``). ``mosaic``
        serves prefill batches in bf16/fp16 with head dim 64 or 128 and T, L multiples of
        8 on Hopper; asked for by name on any other call it raises ``ValueError``.
      config: the chosen backend's block sizes (``attention.mosaic.BlockSizes`` or
        ``attention.triton.BlockSizes``).

    Returns:
      out[T, Hq, D] in ``q``'s dtype; rows with no visible key, of padding sequences or
      past ``query_start_loc[-1]`` are 0.
    """
    q, k_cache, v_cache, query_start_loc, kv_lens, slot_ids = (
        jnp.asarray(a) for a in (q, k_cache, v_cache, query_start_loc, kv_lens, slot_ids)
    )
    checks.check_floating("q", q)
    S, L, Hkv, D = _check_cache(k_cache, v_cache)
    if q.ndim != 3 or q.shape[2] != D:
        raise ValueError(f"q must have shape [T, Hq, D] with D={D}, got {q.shape}")
    T, Hq = q.shape[:2]
    if Hq % Hkv:
        raise ValueError(f"num_q_heads={Hq} must be divisible by num_kv_heads={Hkv}")
    checked_slot_ids = _check_batch(query_start_loc, kv_lens, slot_ids, S)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be None or >= 1")
    if validate:
        _validate_batch(query_start_loc, kv_lens, slot_ids, num_tokens=T, num_slots=S, cache_len=L)
    call = Call(
        (q, k_cache, v_cache),
        dict(
            query_start_loc=query_start_loc.astype(jnp.int32),
            kv_lens=kv_lens.astype(jnp.int32),
            slot_ids=checked_slot_ids,
            causal=bool(causal),
            sm_scale=float(D**-0.5 if sm_scale is None else sm_scale),
            sliding_window=None if sliding_window is None else int(sliding_window),
        ),
        empty=(lambda: q) if T == 0 else None,
    )
    return MASKED_TAIL_ATTENTION.run(call, implementation, config)


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    validate: bool = False,
    implementation: Implementation = "auto",
    config: None = None,
) -> tuple[jax.Array, jax.Array]:
    """Writes this step's keys/values into the caches.

    Token ``i`` of sequence ``b`` goes to position ``kv_lens[b] - q_len[b] + i`` of slot
    ``slot_ids[b]``; padding sequences (slot ``-1``) and positions outside ``[0, L)`` write
    nothing. Functional (in place under buffer donation).

    Args:
      k_cache, v_cache: [S, L, Hkv, D].
      k, v: [T, Hkv, D] this step's keys and values (packed like the queries).
      query_start_loc: int32[B + 1].
      kv_lens: int32[B], valid keys per sequence including this step's tokens.
      slot_ids: int32[B]; ids outside ``[0, S)`` write nothing.
      validate: check the batch on the host.
      implementation: "auto" | "xla" | "triton" | "mosaic", or a sequence of backend names.
      config: no backend of ``write_kv`` takes block sizes; anything but None raises.

    Returns:
      ``(k_cache, v_cache)`` updated.
    """
    k_cache, v_cache, k, v, query_start_loc, kv_lens, slot_ids = (
        jnp.asarray(a) for a in (k_cache, v_cache, k, v, query_start_loc, kv_lens, slot_ids)
    )
    S, L, Hkv, D = _check_cache(k_cache, v_cache)
    if k.ndim != 3:
        raise ValueError(f"k must have shape [T, Hkv, D], got {k.shape}")
    T = k.shape[0]
    checks.check_shape("k", k, (T, Hkv, D), "[T, Hkv, D]")
    checks.check_shape("v", v, (T, Hkv, D), "[T, Hkv, D]")
    checked_slot_ids = _check_batch(query_start_loc, kv_lens, slot_ids, S)
    if validate:
        _validate_batch(query_start_loc, kv_lens, slot_ids, num_tokens=T, num_slots=S, cache_len=L)
    call = Call(
        (k_cache, v_cache, k, v),
        dict(
            query_start_loc=query_start_loc.astype(jnp.int32),
            kv_lens=kv_lens.astype(jnp.int32),
            slot_ids=checked_slot_ids,
        ),
        empty=(lambda: (k_cache, v_cache)) if T == 0 else None,
    )
    return WRITE_KV.run(call, implementation, config)


def kv_lens_from_mask(mask: jax.Array) -> jax.Array:
    """Per-row KV length of an attention mask: end of the last unmasked key.

    For callers that hold a mask rather than lengths (llama.cpp-style). A boolean mask
    marks visible keys True; an integer mask non-zero (Hugging Face ``attention_mask``);
    an additive float mask 0 (or any bias above ``kv_cache.MASKED_BIAS_THRESHOLD``, -1e4)
    for visible keys and −inf / the dtype's lowest value for masked ones.

    Args:
      mask: mask[B, L].

    Returns:
      int32[B]: index of the last visible key + 1, 0 for a row with none.
    """
    mask = jnp.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must have shape [B, L], got {mask.shape}")
    return kv_cache.kv_lens_from_mask(mask)
