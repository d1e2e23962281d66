"""Mamba2 mixer (Dao & Gu, arXiv 2405.21060) over packed variable-length batches."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from flax_models.batch import ForwardBatch
from flax_models.cache import MambaCache, mamba_cache_spec
from flax_models.config import HybridConfig
from flax_models.layers.linear import Linear, linear_kwargs, matmul, scaled
from flax_models.sharding import TP, psum_tp, shard_call, tp_size


class Mamba2Mixer(nnx.Module):
    """in_proj → causal conv + SiLU on xBC → SSD scan → gated RMSNorm → out_proj.

    ``A_log``, ``D`` and ``dt_bias`` stay fp32 whatever the compute dtype. Falcon-H1's
    options (neutral elsewhere): µP multipliers on the input, on each of in_proj's z | x |
    B | C | dt segments and on the output; ``mamba_rms_norm=False`` gates with
    ``y · silu(z)`` inside the SSM ops and has no norm; ``mamba_norm_before_gate``.
    """

    def __init__(
        self,
        cfg: HybridConfig,
        *,
        dtype: jnp.dtype,
        implementation: str | tuple[str, ...],
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.implementation = implementation
        self.mesh = mesh
        # Devices sharing one norm group (tp > mamba_groups): the norm's sum of squares is
        # all-reduced over them. Set on the per-device copy by ``__call__``.
        self.norm_devices = 1
        H, K = cfg.mamba_num_heads, cfg.mamba_conv_kernel
        linear = linear_kwargs(use_bias=cfg.mamba_proj_bias, dtype=dtype, rngs=rngs)
        self.in_proj = Linear(cfg.hidden_size, cfg.mamba_in_proj_dim, **linear)
        self.conv_weight = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.mamba_conv_dim, K), dtype) * K**-0.5
        )
        self.conv_bias = (
            nnx.Param(jnp.zeros((cfg.mamba_conv_dim,), dtype)) if cfg.mamba_conv_bias else None
        )
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, H + 1, dtype=jnp.float32)))
        self.D = nnx.Param(jnp.ones((H,), jnp.float32))
        self.dt_bias = nnx.Param(jnp.full((H,), -2.0, jnp.float32))
        self.norm_weight = (
            nnx.Param(jnp.ones((cfg.mamba_d_inner,), dtype)) if cfg.mamba_rms_norm else None
        )
        self.out_proj = Linear(
            cfg.mamba_d_inner,
            cfg.hidden_size,
            **linear_kwargs(use_bias=cfg.mamba_out_bias, dtype=dtype, rngs=rngs),
        )

    def __call__(
        self, h: jax.Array, batch: ForwardBatch, cache: MambaCache
    ) -> tuple[jax.Array, MambaCache]:
        cfg = self.cfg
        if self.mesh is None:
            y, cache = self._mix(h, batch, cache)
            return scaled(self.out_proj(y), cfg.mamba_out_multiplier), cache
        tp = tp_size(self.mesh)
        norm_devices = tp // cfg.mamba_groups if tp > cfg.mamba_groups else 1
        # One norm group over every device (G = 1): the norm scales each row by one number,
        # which commutes with out_proj, so the devices' sums of squares ride in out_proj's
        # all-reduce and the row is scaled after it: one all-reduce per mixer, not two (at
        # decode each is ~20 µs of latency). Not in fp16, whose range the unscaled partial
        # products could leave (bf16 and fp32 have fp32's exponent range).
        fold_norm = (
            self.norm_weight is not None and norm_devices == tp > 1 and h.dtype != jnp.float16
        )

        def body(local, h, batch, cache):
            local.norm_devices = norm_devices
            kernel = local.out_proj.kernel[...]
            if fold_norm:
                if local._fuses(h, batch, cache):
                    # The fused steps on in_proj's packed rows (no slice copies: at 32k
                    # tokens of Bamba-9B's tp = 2 prefill they cost 0.33 ms a layer, two
                    # H200s), ungated (the decode update's ungated tiling is also faster:
                    # 89.8 against 87.3% of the copy rate at 256 rows of 64 heads, one
                    # H200); the gate rides in the norm's XLA fusion, reading z in place.
                    zxbcdt = local._project(h)
                    y, cache = local._fused_rows(zxbcdt, batch, cache, norm=False, gate=False)
                    terms, squares = local._norm_terms(y, zxbcdt[:, : y.shape[-1]])
                else:
                    y, z, cache = local._ssm(h, batch, cache)
                    terms, squares = local._norm_terms(y, z)
                part = matmul(terms, kernel, precision=local.out_proj.precision)
                part, squares = psum_tp((part, squares), local.implementation, self.mesh)
                inv_rms = local._inv_rms(squares, terms.shape[-1] * tp)
                return (part.astype(jnp.float32) * inv_rms[:, None]).astype(part.dtype), cache
            y, cache = local._mix(h, batch, cache)
            part = matmul(y, kernel, precision=local.out_proj.precision)
            return psum_tp(part, local.implementation, self.mesh), cache

        spec = mamba_cache_spec(cache)
        out, cache = shard_call(self, body, (h, batch, cache), (P(), P(), spec), (P(), spec))
        if self.out_proj.bias is not None:
            out = out + self.out_proj.bias[...]
        return scaled(out.astype(h.dtype), cfg.mamba_out_multiplier), cache

    def _mix(
        self, h: jax.Array, batch: ForwardBatch, cache: MambaCache
    ) -> tuple[jax.Array, MambaCache]:
        """Steps 1-4: everything before the output projection; y[T, d_inner]."""
        cfg = self.cfg
        if self.norm_devices == 1 and self._fuses(h, batch, cache):
            return self._fused_rows(self._project(h), batch, cache)
        y, z, cache = self._ssm(h, batch, cache)
        # 4) Gated grouped RMSNorm (groups of d_inner / G); the output projection follows.
        if self.norm_weight is not None and self.norm_devices > 1:
            y = self._shared_group_norm(y, z)
        elif self.norm_weight is not None:
            y = pk.gated_rms_norm(
                y,
                z,
                self.norm_weight[...],
                group_size=cfg.mamba_d_inner // cfg.mamba_groups,
                eps=cfg.norm_eps,
                norm_before_gate=cfg.mamba_norm_before_gate,
                implementation=self.implementation,
            )
        return y, cache

    def _project(self, h: jax.Array) -> jax.Array:
        """Step 1, the parallel projection: zxbcdt[T, z | xBC | dt] (µP: input and
        per-segment multipliers)."""
        return self._scale_segments(self.in_proj(scaled(h, self.cfg.mamba_in_multiplier)))

    @staticmethod
    def _fuses(h: jax.Array, batch: ForwardBatch, cache: MambaCache) -> bool:
        """Whether the step runs the fused ops (:meth:`_fused_rows`): its rows are all
        decode rows, or it takes no prefix snapshots (the unfused path saves prefill ones)."""
        decode_only = batch.num_decode == h.shape[0]
        return decode_only or not (cache.has_snapshots and batch.snapshots is not None)

    def _fused_rows(
        self,
        zxbcdt: jax.Array,
        batch: ForwardBatch,
        cache: MambaCache,
        *,
        norm: bool = True,
        gate: bool = True,
    ) -> tuple[jax.Array, MambaCache]:
        """Steps 2-4 on in_proj's packed rows ``zxbcdt[T, z | xBC | dt]``, for a step of
        decode rows only or one with no prefix snapshots to take: ``pk.mamba2_decode`` on
        the decode rows and ``pk.mamba2_prefill`` on the prefill rows, their kernels
        reading z, xBC and dt where they lie (no column slice copied: at 32k tokens of
        Bamba-9B each slice copy costs about 0.3 ms a layer on an H200). ``norm=False``:
        steps 2-3 only, y · silu(z) (z gating the SSM ops), or with ``gate=False`` y
        ungated, for a norm the caller completes."""
        cfg, nd = self.cfg, batch.num_decode
        options = dict(gate=gate, **self._norm_params(norm), **self._ssm_params())
        conv = (self.conv_weight[...], self._conv_bias())
        ys = []
        if nd:
            y, conv_state, ssm_state = pk.mamba2_decode(
                zxbcdt[:nd], cache.conv_state, *conv, cache.ssm_state, self._A_log(),
                slot_ids=batch.slot_ids[:nd], **options,
            )  # fmt: skip
            ys.append(y)
            cache = dataclasses.replace(cache, conv_state=conv_state, ssm_state=ssm_state)
            if cache.has_snapshots and batch.snapshots is not None:
                cache = self._save_decode_snapshots(batch, cache)
        if nd < zxbcdt.shape[0]:
            y, conv_state, ssm_state = pk.mamba2_prefill(
                zxbcdt[nd:], cache.conv_state, *conv, cache.ssm_state, self._A_log(),
                query_start_loc=batch.prefill_query_start_loc, metadata=batch.chunks,
                chunk_size=cfg.mamba_chunk_size, slot_ids=batch.slot_ids[nd:],
                has_initial_state=batch.has_initial_state[nd:], **options,
            )  # fmt: skip
            ys.append(y)
            cache = dataclasses.replace(cache, conv_state=conv_state, ssm_state=ssm_state)
        return (jnp.concatenate(ys) if len(ys) > 1 else ys[0]), cache

    def _norm_params(self, norm: bool = True) -> dict:
        """The fused steps' norm arguments (no norm: ``norm=False`` or no norm weight)."""
        cfg = self.cfg
        return dict(
            norm_weight=self.norm_weight[...] if norm and self.norm_weight is not None else None,
            norm_group_size=cfg.mamba_d_inner // cfg.mamba_groups,
            norm_eps=cfg.norm_eps,
            norm_before_gate=cfg.mamba_norm_before_gate,
        )

    def _ssm(
        self, h: jax.Array, batch: ForwardBatch, cache: MambaCache
    ) -> tuple[jax.Array, jax.Array, MambaCache]:
        """Steps 1-3: (y[T, d_inner] before the norm, the gate z[T, d_inner], cache)."""
        cfg = self.cfg
        d_inner, conv_dim = cfg.mamba_d_inner, cfg.mamba_conv_dim
        num_decode = batch.num_decode

        # 1) Parallel projection: z | xBC | dt (µP: input and per-segment multipliers).
        zxbcdt = self._project(h)
        z, xbc, dt = jnp.split(zxbcdt, [d_inner, d_inner + conv_dim], axis=-1)
        # Without the norm (Falcon-H1's mamba_rms_norm=False) the SSM ops gate y · silu(z).
        ssm_gate = None if self.norm_weight is not None else z

        # 2-3) Causal conv + SiLU and the SSM: decode rows one step each, prefill sequences
        # chunked, both continuing from their slots' cached states.
        ys = []
        if num_decode:
            gate = None if ssm_gate is None else ssm_gate[:num_decode]
            y, cache = self._decode(
                xbc[:num_decode], dt[:num_decode], gate, batch.slot_ids[:num_decode], cache
            )
            if cache.has_snapshots and batch.snapshots is not None:
                cache = self._save_decode_snapshots(batch, cache)
            ys.append(y)
        if h.shape[0] > num_decode:
            gate = None if ssm_gate is None else ssm_gate[num_decode:]
            y, cache = self._prefill(xbc[num_decode:], dt[num_decode:], gate, batch, cache)
            ys.append(y)
        y = jnp.concatenate(ys) if len(ys) > 1 else ys[0]
        return y, z, cache

    def _shared_group_norm(self, y: jax.Array, z: jax.Array) -> jax.Array:
        """The gated RMSNorm of one device's share of a norm group that spans
        ``norm_devices`` devices (under ``shard_map``): the sums of squares of the devices
        of each group are added across them, in fp32 as ``pk.gated_rms_norm``. A group that
        spans every device (G = 1): a psum. Groups that each span a subset: all-gathered and
        summed per group (shard_map has no psum over a subset of an axis); at decode an
        all-gather costs about twice an all-reduce (45 against 20 µs on two H200s).
        ``self.cfg`` is the device's local config here, so the span decides, not its G."""
        span = self.norm_devices
        terms, local = self._norm_terms(y, z)
        if span == jax.lax.axis_size(TP):
            group_sum = jax.lax.psum(local, TP)
        else:
            squares = jax.lax.all_gather(local, TP)  # [tp, T]
            squares = squares.reshape(-1, span, y.shape[0]).sum(axis=1)  # [groups, T]
            group_sum = squares[jax.lax.axis_index(TP) // span]
        inv_rms = self._inv_rms(group_sum, y.shape[-1] * span)
        return (terms * inv_rms[:, None]).astype(y.dtype)

    def _norm_terms(self, y: jax.Array, z: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """The gated RMSNorm of one norm group but for its per-row scale, in fp32: the
        normed row is ``terms * rsqrt(squares / group_size + eps)`` with ``terms = u · weight``
        (``· silu(z)`` when the norm comes before the gate) and ``squares = Σ u²`` over the
        row, ``u = y`` or, gate first, ``y · silu(z)``. y, z: [T, d]; terms [T, d],
        squares [T]. Without z, y is already ``y · silu(z)`` (gate first)."""
        f32 = jnp.float32
        before_gate = self.cfg.mamba_norm_before_gate
        u = y.astype(f32)
        gate = None if z is None else jax.nn.silu(z.astype(f32))
        if gate is not None and not before_gate:
            u = u * gate
        terms = u * self.norm_weight[...].astype(f32)
        if gate is not None and before_gate:
            terms = terms * gate
        return terms, jnp.sum(u * u, axis=-1)

    def _inv_rms(self, squares: jax.Array, group_size: int) -> jax.Array:
        """1 / rms of rows whose squares over a norm group of ``group_size`` sum to
        ``squares[T]`` (fp32)."""
        return jax.lax.rsqrt(squares / group_size + self.cfg.norm_eps)

    def _scale_segments(self, zxbcdt: jax.Array) -> jax.Array:
        """Falcon-H1's µP vector: in_proj's z | x | B | C | dt segments times
        ``mamba_zxbcdt_multipliers`` (a constant; nothing when they are all 1)."""
        cfg = self.cfg
        multipliers = cfg.mamba_zxbcdt_multipliers
        if all(m == 1.0 for m in multipliers):
            return zxbcdt
        gn = cfg.mamba_groups * cfg.mamba_state_size
        sizes = (cfg.mamba_d_inner, cfg.mamba_d_inner, gn, gn, cfg.mamba_num_heads)
        return scaled(zxbcdt, np.repeat(np.asarray(multipliers, np.float32), sizes))

    def _split_xbc(self, xbc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """xBC[T, conv_dim] → x[T, H, P], B[T, G, N], C[T, G, N]."""
        cfg = self.cfg
        T, G, N = xbc.shape[0], cfg.mamba_groups, cfg.mamba_state_size
        x, B, C = jnp.split(xbc, [cfg.mamba_d_inner, cfg.mamba_d_inner + G * N], axis=-1)
        return (
            x.reshape(T, cfg.mamba_num_heads, cfg.mamba_head_dim),
            B.reshape(T, G, N),
            C.reshape(T, G, N),
        )

    def _heads(self, gate: jax.Array | None) -> jax.Array | None:
        """z[T, d_inner] → z[T, H, P] for the SSM ops' gate (None stays None)."""
        if gate is None:
            return None
        return gate.reshape(gate.shape[0], self.cfg.mamba_num_heads, self.cfg.mamba_head_dim)

    def _ssm_params(self) -> dict:
        return dict(
            D=self.D[...],
            dt_bias=self.dt_bias[...],
            dt_softplus=True,
            dt_limit=self.cfg.time_step_limit,
            implementation=self.implementation,
        )

    def _A_log(self) -> jax.Array:
        """A_log[H] in fp32: the fused ops (``mamba2_decode``, ``mamba2_prefill``) take it
        as held and form A themselves."""
        return self.A_log[...].astype(jnp.float32)

    def _A(self) -> jax.Array:
        """A[H] = -exp(A_log), for the split ops."""
        return -jnp.exp(self._A_log())

    def _conv_bias(self) -> jax.Array | None:
        return None if self.conv_bias is None else self.conv_bias[...]

    def _decode(
        self,
        xbc: jax.Array,
        dt: jax.Array,
        gate: jax.Array | None,
        slot_ids: jax.Array,
        cache: MambaCache,
    ) -> tuple[jax.Array, MambaCache]:
        """One token per row: conv update and selective state update, in place."""
        xbc, conv_state = pk.causal_conv1d_update(
            xbc,
            cache.conv_state,
            self.conv_weight[...],
            self._conv_bias(),
            slot_ids=slot_ids,
            activation="silu",
            implementation=self.implementation,
        )
        x, B, C = self._split_xbc(xbc)
        y, ssm_state = pk.selective_state_update(
            cache.ssm_state,
            x,
            dt,
            self._A(),
            B,
            C,
            z=self._heads(gate),
            slot_ids=slot_ids,
            **self._ssm_params(),
        )
        return y.reshape(y.shape[0], -1), dataclasses.replace(
            cache, conv_state=conv_state, ssm_state=ssm_state
        )

    def _prefill(
        self,
        xbc: jax.Array,
        dt: jax.Array,
        gate: jax.Array | None,
        batch: ForwardBatch,
        cache: MambaCache,
    ) -> tuple[jax.Array, MambaCache]:
        """Packed prefill sequences: causal conv1d and the chunk-aligned SSD scan."""
        cfg, nd = self.cfg, batch.num_decode
        slot_ids = batch.slot_ids[nd:]
        has_state = batch.has_initial_state[nd:]
        conv_inputs, conv_before = xbc, cache.conv_state
        xbc, conv_state = pk.causal_conv1d(
            xbc,
            self.conv_weight[...],
            self._conv_bias(),
            query_start_loc=batch.prefill_query_start_loc,
            conv_state_cache=cache.conv_state,
            slot_ids=slot_ids,
            has_initial_state=has_state,
            activation="silu",
            implementation=self.implementation,
        )
        x, B, C = self._split_xbc(xbc)
        scan = (
            dict(z=self._heads(gate), metadata=batch.chunks, chunk_size=cfg.mamba_chunk_size)
            | self._ssm_params()
        )
        if not (cache.has_snapshots and batch.snapshots is not None):
            # The scan reads each sequence's state from its slot and writes the final one
            # back (padding writes nothing; a sequence without new tokens keeps its state).
            y, ssm_state = pk.ssd_scan(
                x,
                dt,
                self._A(),
                B,
                C,
                state_cache=cache.ssm_state,
                slot_ids=slot_ids,
                has_initial_state=has_state,
                **scan,
            )
            y = y.reshape(y.shape[0], -1)
            return y, dataclasses.replace(cache, conv_state=conv_state, ssm_state=ssm_state)

        # Prefix caching: the scan returns the state after every chunk; the final state of
        # each sequence is its last chunk's, and chunks ending on a block boundary are the
        # snapshots (chunk alignment puts a chunk end on every multiple of the chunk size).
        chunks = batch.chunks
        initial = pk.slots.gather_states(cache.ssm_state, slot_ids, has_state)
        y, states = pk.ssd_scan(
            x,
            dt,
            self._A(),
            B,
            C,
            initial_states=initial,
            return_intermediate_states=True,
            state_dtype=cache.ssm_state.dtype,
            **scan,
        )
        final = states[jnp.maximum(chunks.last_chunk_indices, 0)]
        ssm_state = pk.slots.write_final_states(cache.ssm_state, final, chunks, slot_ids)
        # Rows of padding sequences give 0, as the state_cache path does.
        live = pk.slots.live_rows(y.shape[0], chunks, slot_ids)
        y = jnp.where(live[:, None, None], y, jnp.zeros((), y.dtype)).reshape(y.shape[0], -1)
        snapshot_conv, snapshot_ssm = self._prefill_snapshots(
            batch, conv_inputs, conv_before, states, cache
        )
        return y, MambaCache(
            conv_state=conv_state,
            ssm_state=ssm_state,
            snapshot_conv=snapshot_conv,
            snapshot_ssm=snapshot_ssm,
        )

    def _prefill_snapshots(
        self,
        batch: ForwardBatch,
        conv_inputs: jax.Array,
        conv_before: jax.Array,
        states: jax.Array,
        cache: MambaCache,
    ) -> tuple[jax.Array, jax.Array]:
        """The snapshot pools with this step's prefill saves (``batch.snapshots``) written.

        Save ``q`` of prefill sequence ``b`` (``nc`` computed before, ``n`` new tokens) at
        boundary ``p``: the SSM state is the scan's state after the chunk ending at ``p``,
        ``cdiv(nc + n, cs) - p // cs`` chunks before the sequence's last; the conv state is
        the inputs at positions ``p - K + 1 .. p - 1``, from this step's packed
        ``conv_inputs[T, conv_dim]`` at or after ``nc``, before it from the slot's conv
        state as it was before this step (``conv_before[S, K - 1, conv_dim]``, the K − 1
        inputs before ``nc``, oldest first). Example, K = 4, nc = 14, p = 16::

            positions   13 14 15 | 16 ..
            window      old[2] new[0] new[1]     old = conv_before[slot], new = packed rows
        """
        cfg, nd, snaps = self.cfg, batch.num_decode, batch.snapshots
        cs, K1 = cfg.mamba_chunk_size, cfg.mamba_conv_kernel - 1
        qsl = batch.prefill_query_start_loc
        num_seqs = qsl.shape[0] - 1
        seq = jnp.clip(snaps.prefill_seqs, 0, num_seqs - 1)
        computed = batch.num_computed_tokens[nd:][seq]
        new = (qsl[1:] - qsl[:-1])[seq]
        pos = snaps.prefill_positions
        ids = jnp.where(snaps.prefill_seqs >= 0, snaps.prefill_ids, -1)

        last = batch.chunks.last_chunk_indices[seq]
        chunk = last - (-(-(computed + new) // cs) - pos // cs)
        chunk = jnp.clip(chunk, 0, states.shape[0] - 1)
        snapshot_ssm = pk.slots.scatter_states(cache.snapshot_ssm, states[chunk], ids)

        at = pos[:, None] - K1 + jnp.arange(K1)[None, :]  # [Q, K-1] absolute positions
        from_new = at >= computed[:, None]
        rows = jnp.clip(qsl[seq][:, None] + at - computed[:, None], 0, conv_inputs.shape[0] - 1)
        slot = jnp.clip(batch.slot_ids[nd:][seq], 0, conv_before.shape[0] - 1)
        old_index = jnp.clip(K1 - (computed[:, None] - at), 0, K1 - 1)
        window = jnp.where(
            from_new[..., None],
            conv_inputs[rows].astype(conv_before.dtype),
            conv_before[slot[:, None], old_index],
        )
        snapshot_conv = pk.slots.scatter_states(cache.snapshot_conv, window, ids)
        return snapshot_conv, snapshot_ssm

    def _save_decode_snapshots(self, batch: ForwardBatch, cache: MambaCache) -> MambaCache:
        """Decode rows ending a block (``batch.snapshots.decode_rows``): their slots' states
        after this token go to the snapshot pools."""
        nd, snaps = batch.num_decode, batch.snapshots
        rows = jnp.clip(snaps.decode_rows, 0, nd - 1)
        live = (snaps.decode_rows >= 0) & (batch.slot_ids[rows] >= 0)
        ids = jnp.where(live, snaps.decode_ids, -1)
        slot = jnp.clip(batch.slot_ids[rows], 0, cache.ssm_state.shape[0] - 1)
        return dataclasses.replace(
            cache,
            snapshot_conv=pk.slots.scatter_states(cache.snapshot_conv, cache.conv_state[slot], ids),
            snapshot_ssm=pk.slots.scatter_states(cache.snapshot_ssm, cache.ssm_state[slot], ids),
        )
