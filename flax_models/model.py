"""``HybridLM``: embeddings, a stack of blocks following the layer pattern, final norm, head.

A block is ``x + mixer(norm(x))`` with the mixer a Mamba2 mixer (``M``), attention (``*``),
both in parallel on the same input (``P``, Falcon-H1: ``layers/parallel.py``), an MLP
(``-``) or a mixture of experts (``E``, Nemotron-H: ``layers/moe.py``); with
``mlp_per_layer`` (Bamba, Granite, Falcon-H1) a mixer block is followed by
``x + mlp(mlp_norm(x))`` (GraniteMoeHybrid with experts: ``x + (mlp + moe)(mlp_norm(x))``).
Residual branches are scaled by ``residual_multiplier`` (Granite; 1 elsewhere). Every
layer runs on the packed kernel API: ``forward`` takes packed tokens, a ``ForwardBatch``
and slot-indexed caches (the serving path), ``__call__`` wraps a dense ``[B, L]`` batch
into that form (research and tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from flax_models.batch import ForwardBatch, make_forward_batch
from flax_models.cache import LayerCache, init_cache
from flax_models.config import HybridConfig
from flax_models.layers import MLP, Attention, Mamba2Mixer, ParallelHybridMixer, RMSNorm
from flax_models.layers.linear import Linear, linear_kwargs, matmul
from flax_models.layers.moe import MoE
from flax_models.sharding import check_tp, state_shardings, tp_layout, tp_size, with_tp_axis

# A model-level implementation names a backend family: "the best it has for each op". Mosaic
# GPU kernels exist only for the tensor-core-bound ops, Triton kernels for every op, so
# "mosaic" asks each op for Mosaic where it has it and Triton elsewhere. "xla", "triton"
# and "auto" exist for every op and pass through.
_FAMILY_BACKENDS: dict[str, str | tuple[str, ...]] = {"mosaic": ("mosaic", "triton")}

# Activation rematerialisation of each block under differentiation: None keeps every
# activation for the backward pass; "block" keeps only each block's input and recomputes
# the block's forward in the backward pass; a ``jax.checkpoint_policies`` policy (e.g.
# ``dots_with_no_batch_dims_saveable``) keeps what it names and recomputes the rest.
RematPolicy = Literal["block"] | Callable[..., bool] | None


def layer_implementation(implementation: str | Sequence[str]) -> str | tuple[str, ...]:
    """The ``implementation=`` a model's layers pass to every op, for the model's own
    ``implementation`` ("auto" | "xla" | "triton" | "mosaic", or a sequence of backend
    names, first that serves a call wins, passed through as a tuple)."""
    if isinstance(implementation, str):
        if implementation not in pk.IMPLEMENTATIONS:
            raise ValueError(f"{implementation=} must be one of {pk.IMPLEMENTATIONS}")
        return _FAMILY_BACKENDS.get(implementation, implementation)
    return pk.backend_names(implementation)


def norm_implementation(
    implementation: str | tuple[str, ...], mesh: Mesh | None
) -> str | tuple[str, ...]:
    """The blocks' RMSNorms' ``implementation``: the layers' own on one device; ``"xla"``
    on a mesh, where XLA partitions the residual stream's ops (and fuses the norm into
    them) while the Pallas ops run under the mixers' ``shard_map``."""
    return implementation if mesh is None else "xla"


class Block(nnx.Module):
    """One residual block of the layer pattern."""

    def __init__(
        self,
        cfg: HybridConfig,
        kind: str,
        *,
        dtype: jnp.dtype,
        implementation: str | tuple[str, ...],
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
    ):
        self.kind = kind
        self.residual_multiplier = cfg.residual_multiplier
        norm = functools.partial(
            RMSNorm,
            cfg.hidden_size,
            eps=cfg.norm_eps,
            dtype=dtype,
            implementation=norm_implementation(implementation, mesh),
        )
        self.norm = norm()
        mixers = {"M": Mamba2Mixer, "*": Attention, "P": ParallelHybridMixer, "E": MoE}
        options = dict(dtype=dtype, implementation=implementation, rngs=rngs, mesh=mesh)
        if kind == "-":
            self.mixer = MLP(cfg, **options)
        else:
            self.mixer = mixers[kind](cfg, **options)
        has_mlp = cfg.mlp_per_layer and kind not in "-E"
        self.mlp_norm = norm() if has_mlp else None
        self.mlp = MLP(cfg, **options) if has_mlp else None
        # Granite MoE: routed experts beside the per-layer MLP (its shared expert), same input.
        has_moe = has_mlp and cfg.moe_per_layer
        self.moe = MoE(cfg, **options) if has_moe else None

    def __call__(
        self, h: jax.Array, update: jax.Array | None, batch: ForwardBatch, cache: LayerCache
    ) -> tuple[jax.Array, jax.Array, LayerCache]:
        """``h[T, D]``: the residual stream; ``update[T, D]``: the previous block's output,
        not yet added to it (None before the first block). Returns the stream, this block's
        own output, also not yet added (the next norm adds it in its own pass), and the
        cache."""
        if update is None:
            x = self.norm(h)
        else:
            x, h = self.norm(update, h)
        if self.kind in "-E":  # MLP and MoE blocks carry no state; a grouped batch's
            out = self.mixer(x, groups=batch.groups)  # tokens stay split over dp
        else:
            out, cache = self.mixer(x, batch, cache)
        update = out * self.residual_multiplier
        if self.mlp is not None:
            x, h = self.mlp_norm(update, h)
            if self.moe is None:
                out = self.mlp(x, groups=batch.groups)
            else:
                out = self.mlp(x, groups=batch.groups) + self.moe(x, groups=batch.groups)
            update = out * self.residual_multiplier
        return h, update, cache


class HybridLM(nnx.Module):
    """Hybrid Mamba2/attention causal language model.

    Args:
      cfg: the architecture.
      dtype: parameters and compute (``A_log``, ``D``, ``dt_bias`` stay fp32).
      implementation: the kernels' backend family, "auto" | "xla" | "triton" | "mosaic"
        (Mosaic kernels where an op has them, Triton elsewhere), or a sequence of backend
        names; see :func:`layer_implementation`.
      rngs: parameter initialisation.
      remat: activation rematerialisation of each block when differentiated (training),
        :data:`RematPolicy`: None, "block" (recompute the whole block in the backward pass)
        or a ``jax.checkpoint_policies`` policy. Forward outputs are the same whatever it
        is; the serving path never differentiates, so it is unaffected.
      mesh: a ``jax.sharding.Mesh`` with an axis ``"tp"``: the parameters are created
        straight into their shards over it (Mamba2 heads, attention heads, MLP and expert
        widths; ``flax_models.sharding``) and the forward runs tensor-parallel with the
        single-device results. ``ValueError`` naming the field that tp does not divide.
        An axis ``"dp"`` (with or without ``"tp"``) replicates the parameters over it; the
        ``Engine`` splits its sequence slots over it, a plain forward runs replicated. A
        dp-only mesh is kept as ``self.mesh`` with a ``"tp"`` axis of size 1 appended.
    """

    def __init__(
        self,
        cfg: HybridConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        implementation: str | Sequence[str] = "auto",
        rngs: nnx.Rngs,
        remat: RematPolicy = None,
        mesh: Mesh | None = None,
        _unplaced: bool = False,
    ):
        if not (remat is None or remat == "block" or callable(remat)):
            raise ValueError(f"{remat=} must be None, 'block' or a jax.checkpoint_policies policy")
        mesh = with_tp_axis(mesh)
        if mesh is not None and not _unplaced:
            # Built part by part in jitted programs whose outputs are the parameters'
            # shards: no device ever holds the whole model.
            check_tp(cfg, tp_size(mesh))
            model = _create_sharded(cfg, dtype, implementation, rngs, mesh, remat)
            for name, value in vars(model).items():
                if not name.startswith("_"):
                    setattr(self, name, value)
            return
        self.cfg = cfg
        self.mesh = mesh
        self.dtype = jnp.dtype(dtype)
        self.remat = remat
        layer_impl = layer_implementation(implementation)
        self.implementation = implementation if isinstance(implementation, str) else layer_impl
        # The parts in the order they draw from rngs (_create_sharded builds them so too).
        self.embed = self._embedding(rngs)
        self.layers = nnx.List([self._block(kind, rngs) for kind in cfg.layer_pattern])
        self.final_norm = self._final_norm()
        self.lm_head = None if cfg.tie_word_embeddings else self._head(rngs)

    def _embedding(self, rngs: nnx.Rngs) -> nnx.Embed:
        cfg, dtype = self.cfg, self.dtype
        return nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def _block(self, kind: str, rngs: nnx.Rngs) -> Block:
        layer_impl = layer_implementation(self.implementation)
        return Block(
            self.cfg, kind, dtype=self.dtype, implementation=layer_impl, rngs=rngs, mesh=self.mesh
        )

    def _final_norm(self, rngs: nnx.Rngs | None = None) -> RMSNorm:
        del rngs  # ones
        implementation = norm_implementation(layer_implementation(self.implementation), self.mesh)
        return RMSNorm(
            self.cfg.hidden_size,
            eps=self.cfg.norm_eps,
            dtype=self.dtype,
            implementation=implementation,
        )

    def _head(self, rngs: nnx.Rngs) -> Linear:
        cfg = self.cfg
        return Linear(
            cfg.hidden_size,
            cfg.vocab_size,
            **linear_kwargs(use_bias=False, dtype=self.dtype, rngs=rngs),
        )

    def forward(
        self,
        tokens: jax.Array,
        batch: ForwardBatch,
        caches: tuple[LayerCache, ...],
        *,
        logits_rows: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[LayerCache, ...]]:
        """Packed tokens[T] → (logits[T, V] in fp32, updated caches); with
        ``logits_rows[R]`` only those rows' logits, ``[R, V]`` (a serving step needs each
        sequence's last token, not T × V logits); with a grouped batch (``batch.groups =
        G``) they are G equal runs, run g's rows among group g's tokens.

        ``tokens`` must lie in ``[0, V)``; they are not checked here (they are traced when
        serving): an id past the table gives NaN rows, a negative one wraps around.
        """
        h = self.embed(tokens) * jnp.asarray(self.cfg.embedding_multiplier, self.dtype)
        block = Block.__call__
        if self.remat is not None:  # "block": jax.checkpoint's default, save nothing inside
            block = nnx.remat(block, policy=None if self.remat == "block" else self.remat)
        new_caches = []
        update = None  # the last block's output, added to h by the final norm
        for layer, cache in zip(self.layers, caches, strict=True):
            h, update, cache = block(layer, h, update, batch, cache)
            new_caches.append(cache)

        def rows(a: jax.Array) -> jax.Array:
            """The rows of ``a[T, D]`` whose logits are asked for."""
            if logits_rows is None:
                return a
            if batch.groups == 1:
                return a[logits_rows]
            # A grouped step: each group's rows come from its own tokens, so the hidden
            # states stay split over dp (a global gather would all-gather them).
            groups, width = batch.groups, a.shape[-1]
            local = logits_rows.reshape(groups, -1) - (
                a.shape[0] // groups * jnp.arange(groups, dtype=logits_rows.dtype)[:, None]
            )
            a = a.reshape(groups, -1, width)
            return jnp.take_along_axis(a, local[..., None], axis=1).reshape(-1, width)

        if update is None:
            h = self.final_norm(rows(h))
        else:
            h, _ = self.final_norm(rows(update), rows(h))
        if self.lm_head is None:  # tied: the embedding table is the head
            table = self.embed.embedding[...]
            logits = matmul(h, table.T, precision=pk.matmul_precision(table.dtype))
        else:
            logits = self.lm_head(h)
        return logits.astype(jnp.float32) / self.cfg.logits_scaling, tuple(new_caches)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """input_ids[B, L] → logits[B, L, V] (fp32), every row a fresh sequence.

        Token ids must lie in ``[0, vocab_size)``. Concrete ids are checked (``ValueError``);
        traced ids (under ``jax.jit``) cannot be, and out-of-range ones give NaN logits or,
        negative, wrap around. ``B = 0`` or ``L = 0`` gives empty logits.
        """
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must have shape [B, L], got {input_ids.shape}")
        if not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        num_seqs, length = input_ids.shape
        vocab = self.cfg.vocab_size
        if num_seqs * length == 0:  # nothing to run: no sequence, or no token in any
            return jnp.zeros((num_seqs, length, vocab), jnp.float32)
        if not isinstance(input_ids, jax.core.Tracer):
            ids = np.asarray(input_ids)
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= vocab:
                raise ValueError(
                    f"input_ids must lie in [0, vocab_size={vocab}), got ids from {low} to {high}"
                )
        if self.mesh is not None and not isinstance(input_ids, jax.core.Tracer):
            # One program: op-by-op dispatch would run every op of every shard_map body
            # as its own program.
            return _dense_whole_logits(self, input_ids)
        return self._dense(input_ids)

    def _dense(self, input_ids: jax.Array) -> jax.Array:
        """``__call__`` on checked, non-empty ids."""
        num_seqs, length = input_ids.shape
        batch = make_forward_batch(
            jnp.arange(num_seqs + 1, dtype=jnp.int32) * length,
            jnp.zeros((num_seqs,), jnp.int32),
            jnp.arange(num_seqs, dtype=jnp.int32),
            num_tokens=num_seqs * length,
            chunk_size=self.cfg.mamba_chunk_size,
        )
        caches = init_cache(
            self.cfg, num_slots=num_seqs, max_len=length, dtype=self.dtype, mesh=self.mesh
        )
        logits, _ = self.forward(input_ids.reshape(-1), batch, caches)
        return logits.reshape(num_seqs, length, -1)


def _create_sharded(
    cfg: HybridConfig,
    dtype: jnp.dtype,
    implementation: str | Sequence[str],
    rngs: nnx.Rngs,
    mesh: Mesh,
    remat: RematPolicy,
) -> HybridLM:
    """``HybridLM(cfg, mesh=mesh)`` initialised part by part (the embedding, each block,
    the head), each part in a jitted program: its single-device initial values (the same
    draws, in the same order as one device's ``__init__``), moved to the tp-major layouts
    and constrained to their shardings, so each device computes only its shards. Blocks of
    one kind share one program (their draws differ by the rngs' counter, an input): one
    program over every part took 65-72 s to compile for Bamba-9B's 32 layers on a GPU host
    (2026-11-28)."""
    tp = tp_size(mesh)
    model = nnx.eval_shape(
        lambda: HybridLM(
            cfg,
            dtype=dtype,
            implementation=implementation,
            rngs=nnx.Rngs(0),
            remat=remat,
            mesh=mesh,
            _unplaced=True,
        )
    )
    programs: dict[str, Callable[[nnx.Rngs], nnx.Module]] = {}

    def create(part: str, build: Callable[[nnx.Rngs], nnx.Module]) -> nnx.Module:
        """``build(rngs)`` placed on the mesh, by the program named ``part`` (also the
        module's name for the layout and sharding rules, which read a parameter's name and
        its owner's)."""
        if part not in programs:

            @nnx.jit
            def program(rngs: nnx.Rngs) -> nnx.Module:
                graphdef, state = nnx.split(build(rngs))
                flat = [
                    (path, var.replace(tp_layout((part, *map(str, path)), var[...], cfg, tp)))
                    for path, var in nnx.to_flat_state(state)
                ]
                state = nnx.from_flat_state(flat)
                shardings = state_shardings(state, mesh, prefix=(part,))
                return nnx.merge(graphdef, jax.lax.with_sharding_constraint(state, shardings))

            programs[part] = program
        return programs[part](rngs)

    model.embed = create("embed", model._embedding)
    layers = []
    for kind in cfg.layer_pattern:
        layers.append(create(f"block {kind}", functools.partial(model._block, kind)))
    model.layers = nnx.List(layers)
    model.final_norm = create("final_norm", model._final_norm)
    if model.lm_head is not None:
        model.lm_head = create("lm_head", model._head)
    return model


@nnx.jit
def _dense_whole_logits(model: HybridLM, input_ids: jax.Array) -> jax.Array:
    """``model._dense`` as one program on the model's mesh, the logits whole on every
    device: a split head leaves them split over its vocabulary, and a caller holding
    concrete ids reads them (under several processes, from its own devices). Traced calls
    keep them split (a loss reduces over them where they lie)."""
    logits = model._dense(input_ids)
    return jax.lax.with_sharding_constraint(logits, NamedSharding(model.mesh, P()))
