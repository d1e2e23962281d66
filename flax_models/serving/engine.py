"""Serving: a jitted step over slot-indexed caches, and a scheduler that generates.

Each step packs decode rows (one token per running sequence, through the single-step
conv/SSM update kernels) and prefill chunks (prompt tokens within the per-step token
budget, through the chunked conv and SSD scan, continuing from the cached state) into one
bucketed batch. Caches are donated to the jitted step and updated in place. Requests join
as slots free up and leave when done (continuous batching); a prompt longer than the
budget is spread over several steps (chunked prefill).

Sampling runs on the device (``flax_models.serving.sampling``): every step program also
takes the argmax of its logits, which is all a greedy step needs, and a step where some row
draws runs a sampler program after it, with each row's temperature, top-k, top-p, seed and
token counter as data. So a step is one program per bucket whatever the mix of sampling
settings, and the sampler one of two per count of rows (drawing, drawing with
top-k/top-p), picked on the host: after ``warmup()`` every program a generation can need is
compiled and ``compile_count`` stays put. Nothing in either waits on the host, so
``stream`` launches step n + 1 before it reads step n's tokens (``_schedule``). Each
request draws with its own key, ``fold_in(key(seed), index of the token among its
generated tokens)``, so its tokens never depend on what it is batched with.

Attention K/V live in a pool of pages (``kv_block_size`` tokens each) that per-slot block
tables index; a sequence takes pages as it grows and gives them back when it ends
(``flax_models.serving.prefix_cache.BlockManager``). With ``prefix_caching=True`` a prompt
starts after the longest run of full blocks computed before with the same tokens: their
pages are shared and the Mamba conv/SSM states at the end of the run are restored from a
snapshot saved when those blocks were computed (the chunk-aligned scan's state at the
block boundary, the conv window before it), inside the step that runs the prompt's first
new tokens. Restores and saves are data of the step (``-1`` where none), so they add no
program.

On a mesh with a ``"dp"`` axis (data parallelism, ``flax_models.sharding``) the slots, the
KV page pool and the snapshot pool are split into dp equal groups, each held by its group's
devices, each group with its own prefix cache; a sequence is admitted into the group with
the longest prefix hit, then the most free slots, then the most free pages, and takes pages
and snapshots only from its group's pools. A step is still one program per
bucket over the whole mesh: every group is laid out in the same buckets (the largest any
group needs) and runs its own sequences on its own devices; the token budget is each
group's (every group prefills up to ``token_budget`` tokens per step).
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
import operator
import reprlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from flax_models.batch import StateSnapshots, make_forward_batch, make_grouped_forward_batch
from flax_models.batching import FROM_DEVICE, BatchBuilder, Request, StepArrays
from flax_models.cache import cache_specs, init_cache, restore_snapshots
from flax_models.model import HybridLM
from flax_models.serving.prefix_cache import BlockManager, GroupedBlockManager, block_keys
from flax_models.serving.sampling import (
    SamplingParams,
    check_int,
    greedy_tokens,
    request_keys,
    sample_tokens,
    sampler_flags,
    sampling_arrays,
)
from flax_models.sharding import DP, dp_size, step_compiler_options

__all__ = ["DEFAULT_TOKEN_BUCKET_POLICY", "Engine", "TokenEvent", "sample_tokens"]

# Decode snapshot saves per step (``Engine._snapshot_capacity``).
_DECODE_SAVES = 4

# The default token buckets' spacing (``pk.token_buckets``). Powers of √2 hold n prompt
# tokens in at most max(16, ceil16(√2 n)) (~41% padding once n is in the hundreds; powers of
# two: 100%) for about twice the buckets, still logarithmic in the budget. Measured on
# Bamba-9B's shape (README, "Token bucket policies"): the serving trace's prompt-token
# padding 15.3% → 9.1% for 16 programs used instead of 11, and the ragged 22.5k-token
# prefill runs in 23,184 tokens rather than multiples of 4096's 24,576.
DEFAULT_TOKEN_BUCKET_POLICY: pk.metadata.TokenBucketPolicy = "sqrt2"


@dataclasses.dataclass
class _Sequence:
    """Host-side state of one request."""

    index: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]  # the engine's eos ids and the request's stop_token_ids
    slot: int | None = None
    num_computed: int = 0  # tokens already in the cache
    generated: list[int] = dataclasses.field(default_factory=list)
    keys: list[int] = dataclasses.field(default_factory=list)  # hash chain of full blocks
    restore: int | None = None  # snapshot to restore before its first computed token
    in_flight: int = 0  # tokens sampled by launched steps the host has not read yet
    ended: bool = False  # its last token was read; rows of it launched ahead are discarded

    @property
    def prompt_done(self) -> bool:
        """Every prompt token is computed (or in a launched step)."""
        return self.num_computed >= len(self.prompt)

    @property
    def num_generated(self) -> int:
        """Tokens generated, those in flight included."""
        return len(self.generated) + self.in_flight

    def tokens(self) -> list[int]:
        """The tokens fed so far and the next one: prompt, then generated."""
        return self.prompt + self.generated if self.generated else self.prompt


class _Fed(NamedTuple):
    """A sequence's part in a launched step: ``count`` tokens from ``start`` computed,
    ``samples`` (its row's token is its next one), ``restored`` (the step restored its
    prefix snapshot)."""

    seq: _Sequence
    start: int
    count: int
    samples: bool
    restored: bool


class _Launched(NamedTuple):
    """A step launched by ``stream`` whose tokens the host has not read yet: its arrays,
    its sequences (``fed``, in request order, and their ``rows``), the sampled ``tokens``
    on the device, its snapshot entries ``taken`` ({sequence index: {block: entry}}), and
    when it was launched."""

    arrays: StepArrays
    fed: list[_Fed]
    rows: np.ndarray
    tokens: jax.Array
    taken: dict[int, dict[int, int]]
    launched_at: float


class TokenEvent(NamedTuple):
    """One generated token of ``Engine.stream``: request ``index`` (prompt order), the
    ``token``, and ``finish_reason`` when it is the request's last (``"stop"``: an eos or
    stop token, or the ``stop`` callback said so; ``"length"``: ``max_new_tokens``)."""

    index: int
    token: int
    finish_reason: Literal["stop", "length"] | None


def _with_samples(slot_tokens: jax.Array, slot_ids: jax.Array, tokens: jax.Array) -> jax.Array:
    """``slot_tokens[G, S/G]`` (each slot group's slots) with each sequence row's token
    ``tokens[R]`` written to its slot ``slot_ids[R]`` (global ids; the rows are the groups'
    one after another, group g's slots ``g S/G + j``). A prompt not done yet leaves one
    nobody reads (its next row is a prefill row again); padding rows (slot -1) write
    nothing. Each group writes its own row of ``slot_tokens``: split over dp, no device
    reads another group's tokens."""
    groups, per_group = slot_tokens.shape
    ids = slot_ids.reshape(groups, -1)
    local = jnp.where(ids >= 0, ids % per_group, per_group)
    write = jax.vmap(lambda row, slots, values: row.at[slots].set(values, mode="drop"))
    return write(slot_tokens, local, tokens.reshape(groups, -1))


def _check_buckets(
    name: str, buckets: Sequence[int] | None, default: tuple[int, ...], *, covers: int, what: str
) -> tuple[int, ...]:
    """``buckets`` (``default`` when None) as sorted, distinct sizes >= 1, the largest
    ``>= covers`` (the most a step can hold: ``what``); ValueError naming ``name``."""
    if buckets is None:
        return default
    try:
        sizes = tuple(sorted({operator.index(b) for b in buckets}))
    except TypeError:
        raise ValueError(f"{name}={buckets!r} must be a sequence of ints") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{name}={buckets!r} must be non-empty sizes >= 1")
    if sizes[-1] < covers:
        raise ValueError(f"{name}={buckets!r}: the largest must be >= {what}={covers}")
    return sizes


class Engine:
    """Serves a ``HybridLM`` over ``max_slots`` cache slots of ``max_len`` tokens.

    Args:
      model: the model (its ``implementation`` picks the kernels).
      max_slots: sequences in flight at once (>= 1); more requests wait. On a mesh with a
        ``"dp"`` axis, divisible by dp: each slot group gets ``max_slots / dp`` of them.
      max_len: tokens per sequence, prompt + generated (>= 1).
      token_budget: prompt tokens per step (>= 1; decode rows come on top); with dp slot
        groups, of each group.
      decode_buckets: allowed decode-row counts (of each slot group); powers of two up to
        ``max_slots / dp`` by default. The largest must hold ``max_slots / dp`` rows (every
        sequence of a group decoding).
      token_buckets: allowed prefill token counts; by default powers of √2 rounded up to
        multiples of 16, from 16 up to the first one >= ``token_budget``
        (``pk.token_buckets(policy=DEFAULT_TOKEN_BUCKET_POLICY)``): a step's n prompt tokens
        run in at most ``max(16, ceil16(√2 n))``, for about ``2 log2(token_budget / 16)``
        buckets. The largest must hold ``token_budget`` tokens (a full prefill step).
      kv_block_size: tokens per KV page (>= 1); the model's ``mamba_chunk_size`` by
        default (a field of configs without Mamba layers too). With prefix caching and
        Mamba layers, a multiple of the chunk size (states are saved at chunk ends).
      num_kv_blocks: pages in the KV pool (>= 1); by default enough for every slot to
        hold ``max_len`` tokens. A request needing more pages than the pool holds is
        rejected; one needing more than are free now waits. With dp slot groups,
        divisible by dp (each group's share holds its sequences' pages).
      prefix_caching: reuse the attention pages and Mamba states of prompt prefixes
        computed before (whole blocks); outputs are those without caching. With dp slot
        groups each group caches its own prefixes (a hit uses its group's pages and
        snapshots); a request goes to the group with the longest hit first.
      num_prefix_snapshots: entries of the Mamba state snapshot pool (prefix caching of a
        model with Mamba layers; H·P·N·4 bytes per Mamba layer each): ``2 * max_slots`` by
        default (divisible by dp with dp slot groups: each group gets an equal share).
        Least recently used snapshots are overwritten first.

    Attributes:
      compile_count: programs compiled for this engine's steps: one per bucket (its greedy
        tokens included), and the sampler's two (drawing, drawing with top-k/top-p) per
        count of sequence rows.
      blocks: the ``BlockManager`` of the KV pages and the prefix cache; with dp slot
        groups a ``GroupedBlockManager`` (one ``BlockManager`` per group).
      stats: wall time and real tokens of the steps served, split into prefill (prompt
        tokens) and decode (one token per decode row): ``prefill_seconds``,
        ``prefill_tokens``, ``decode_seconds``, ``decode_tokens``. A mixed step runs both
        in one program; its time is shared in proportion to its tokens. Prefix caching:
        ``prefix_hit_tokens`` (prompt tokens not computed), ``prefix_hits`` and
        ``prefix_misses`` (requests that did or did not start from a cached prefix; all
        0 without caching).
    """

    def __init__(
        self,
        model: HybridLM,
        *,
        max_slots: int = 8,
        max_len: int = 256,
        token_budget: int = 64,
        decode_buckets: Sequence[int] | None = None,
        token_buckets: Sequence[int] | None = None,
        kv_block_size: int | None = None,
        num_kv_blocks: int | None = None,
        prefix_caching: bool = False,
        num_prefix_snapshots: int | None = None,
    ):
        max_slots = check_int("max_slots", max_slots, low=1)
        groups = dp_size(model.mesh)  # the slot groups, one per "dp" index of the mesh
        max_len = check_int("max_len", max_len, low=1)
        token_budget = check_int("token_budget", token_budget, low=1)
        cfg = model.cfg
        has_mamba = bool(set("MP") & set(cfg.layer_pattern))
        if kv_block_size is None:
            # The Mamba chunk size (DESIGN §8): a cached prefix of one chunk or more hits;
            # configs without Mamba layers keep the field too (256 unless set).
            kv_block_size = cfg.mamba_chunk_size
        block_size = check_int("kv_block_size", kv_block_size, low=1)
        if prefix_caching and has_mamba and block_size % cfg.mamba_chunk_size:
            raise ValueError(
                f"kv_block_size={block_size} must be a multiple of the Mamba chunk size "
                f"{cfg.mamba_chunk_size} for prefix caching (states are saved at chunk ends)"
            )
        max_blocks = -(-max_len // block_size)
        num_kv_blocks = check_int(
            "num_kv_blocks",
            max_slots * max_blocks if num_kv_blocks is None else num_kv_blocks,
            low=1,
        )
        if num_prefix_snapshots is not None and not (prefix_caching and has_mamba):
            raise ValueError(
                f"num_prefix_snapshots={num_prefix_snapshots!r} needs "
                + (
                    "prefix_caching=True"
                    if not prefix_caching
                    else "a model with Mamba layers (this one has none: leave it None)"
                )
            )
        num_snapshots = 0
        if prefix_caching and has_mamba:
            num_snapshots = check_int(
                "num_prefix_snapshots",
                2 * max_slots if num_prefix_snapshots is None else num_prefix_snapshots,
                low=1,
            )
        if groups > 1:
            for name, value in (
                ("max_slots", max_slots),
                ("num_kv_blocks", num_kv_blocks),
                ("num_prefix_snapshots", num_snapshots),
            ):
                if value % groups:
                    raise ValueError(
                        f"{name}={value} must be divisible by the mesh's dp={groups} (each "
                        "slot group holds an equal share)"
                    )
        self.block_size = block_size
        self.prefix_caching = bool(prefix_caching)
        slots_per_group = max_slots // groups
        # One manager per slot group; the grouped view also translates snapshot ids between
        # global (the host's) and group-local (the step's), also for a single group.
        self._grouped = GroupedBlockManager(
            BlockManager(
                num_pages=num_kv_blocks // groups,
                block_size=block_size,
                num_slots=slots_per_group,
                max_blocks=max_blocks,
                num_snapshots=num_snapshots // groups,
                prefix_caching=self.prefix_caching,
                needs_state=has_mamba,
            )
            for _ in range(groups)
        )
        self._block_groups = self._grouped.groups
        self.blocks = self._block_groups[0] if groups == 1 else self._grouped
        self._tables = None  # the device copy of blocks.tables, and its version
        self._tables_version = -1
        self.cfg = cfg
        self.token_budget = token_budget
        self.builder = BatchBuilder(
            num_slots=max_slots,
            max_len=max_len,
            decode_buckets=_check_buckets(
                "decode_buckets",
                decode_buckets,
                pk.sequence_buckets(slots_per_group),
                covers=slots_per_group,
                what="max_slots" if groups == 1 else "max_slots / dp",
            ),
            token_buckets=_check_buckets(
                "token_buckets",
                token_buckets,
                pk.token_buckets(token_budget, min_tokens=16, policy=DEFAULT_TOKEN_BUCKET_POLICY),
                covers=token_budget,
                what="token_budget",
            ),
            prefill_seqs=slots_per_group,
            vocab_size=self.cfg.vocab_size,
            groups=groups,
        )
        self._cache_dtype = model.dtype
        self._mesh = model.mesh  # a sharded model serves on its mesh, caches split alike
        self.caches = self._init_cache()
        # The parameters travel to every step as a flat list of arrays: flattening the
        # nnx.State of a 9B model (hundreds of Variables, in Python) on every dispatch cost
        # more host time than the rest of the step's launch.
        self._graphdef, params = nnx.split(model)
        self._param_leaves, self._param_tree = jax.tree.flatten(params)
        # The token each slot sampled last, on the device: a decode row whose token is
        # ``FROM_DEVICE`` is fed from it, so a step can be launched before the host has read
        # the one before (``stream``).
        self._slot_tokens = self._zero_slot_tokens()
        self._clock = 0.0  # when the host last saw a step of ``stream`` finish
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self.compile_count = 0
        self.stats = dict.fromkeys(
            ("prefill_seconds", "prefill_tokens", "decode_seconds", "decode_tokens"), 0
        )
        self.stats.update(prefix_hit_tokens=0, prefix_hits=0, prefix_misses=0)
        self.step_buckets: collections.Counter[tuple[int, int]] = collections.Counter()
        self._jitted = self._jit_step()
        # The steps that XLA compiles with options of their own (``step_compiler_options``),
        # one jit per set of options; every bucket still compiles once, in one of them.
        self._tuned: dict[tuple, Callable] = {}
        # The step takes the argmax of its logits (a greedy step launches nothing else: a
        # program launch and, under tp, a rendezvous of the devices' launch threads less).
        # Drawing is a program of its own, picked on the host: whether a step's rows draw
        # or restrict is host data, and deciding it on the device (a lax.cond) would make
        # the host wait for every step before it could launch the next.
        self._sampler = jax.jit(
            self._sample, static_argnames=("draws", "restricts"), donate_argnums=(1,)
        )

    # ------------------------------------------------------------------------ one step

    def _init_cache(self):
        return init_cache(
            self.cfg,
            num_slots=self.builder.num_slots,
            max_len=self.builder.max_len,
            dtype=self._cache_dtype,
            mesh=self._mesh,
            num_blocks=self.blocks.num_pages,
            block_size=self.block_size,
            num_snapshots=self.blocks.num_snapshots,
            groups=self.builder.groups,
        )

    def _step(
        self,
        param_leaves,
        caches,
        slot_tokens,
        tokens,
        query_start_loc,
        num_computed,
        slot_ids,
        block_tables,
        restore_ids,
        snapshots,
        *,
        num_decode,
    ):
        """One step: ``(logits[R, V], caches, greedy[R], slot_tokens)``, ``greedy`` the
        argmax of each row's logits and ``slot_tokens`` updated with it.
        ``slot_tokens[G, S/G]``: each slot's last sampled token, read by decode rows whose
        token is ``FROM_DEVICE``.
        ``block_tables[S, max_blocks]``: every slot's pages; ``restore_ids[R - num_decode]``:
        the snapshot each prefill row's slot starts from (-1: none) and ``snapshots`` the
        states this step saves, both None without prefix caching.

        With G slot groups the step's arrays are the groups' one after another
        (``BatchBuilder``; ``restore_ids[G · (R/G - num_decode)]``, the snapshot columns G
        times as long), with global slot ids and group-local pages and snapshot entries:
        the batch is grouped here (``make_grouped_forward_batch``), each group's slots made
        local to its share of the caches, while the logits rows and the sampler keep global
        rows and slots (``slot_tokens`` has a row per group: ``_with_samples``)."""
        self.compile_count += 1  # runs once per trace, i.e. per compiled program
        model = nnx.merge(self._graphdef, jax.tree.unflatten(self._param_tree, param_leaves))
        groups, per_group = slot_tokens.shape
        group_tokens = tokens.shape[0] // groups
        tokens = tokens.reshape(groups, group_tokens)  # each group's decode rows lead
        decode_tokens = tokens[:, :num_decode]
        # Each group's rows read its own slots (padding rows an arbitrary one, unused).
        fed_slots = slot_ids.reshape(groups, -1)[:, :num_decode] % per_group
        fed = jnp.take_along_axis(slot_tokens, fed_slots, axis=1)
        tokens = tokens.at[:, :num_decode].set(
            jnp.where(decode_tokens == FROM_DEVICE, fed, decode_tokens)
        )
        tokens = tokens.reshape(-1)
        # Group-local slot ids (the groups' shares of the caches); the same ids at G = 1.
        local_slots = jnp.where(slot_ids >= 0, slot_ids % self.builder.slots_per_group, -1)
        if restore_ids is not None:
            caches = self._restore(caches, local_slots, restore_ids, num_decode=num_decode)
        # Padding rows read slot 0's table; nothing reads or writes for them.
        block_table = block_tables[jnp.clip(slot_ids, 0, block_tables.shape[0] - 1)]
        options = dict(
            num_tokens=group_tokens, chunk_size=self.cfg.mamba_chunk_size, num_decode=num_decode
        )
        if groups == 1:
            batch = make_forward_batch(
                query_start_loc,
                num_computed,
                slot_ids,
                block_table=block_table,
                snapshots=snapshots,
                **options,
            )
        else:
            batch = make_grouped_forward_batch(
                query_start_loc.reshape(groups, -1),
                num_computed.reshape(groups, -1),
                local_slots.reshape(groups, -1),
                block_table=block_table.reshape(groups, -1, block_table.shape[-1]),
                snapshots=jax.tree.map(lambda x: x.reshape(groups, -1), snapshots),
                **options,
            )
        # Each sequence's last token, as a global row (padding sequences read an arbitrary
        # row).
        starts = query_start_loc.reshape(groups, -1)
        offsets = group_tokens * jnp.arange(groups, dtype=starts.dtype)[:, None]
        last_rows = (jnp.maximum(starts[:, 1:] - 1, 0) + offsets).reshape(-1)
        logits, caches = model.forward(tokens, batch, caches, logits_rows=last_rows)
        greedy = greedy_tokens(logits)
        return logits, caches, greedy, _with_samples(slot_tokens, slot_ids, greedy)

    def _restore(self, caches, slot_ids, restore_ids, *, num_decode):
        """``caches`` with each prefill row's snapshot ``restore_ids[G · (R/G - num_decode)]``
        (group-local entries, -1: none) copied into its slot (``slot_ids[R]``, group-local).
        With G slot groups each group's devices copy within their own share of the caches,
        under ``shard_map``: indexing the dp-split pools with global ids would leave XLA to
        gather them across groups."""
        groups = self.builder.groups
        prefill_slots = slot_ids.reshape(groups, -1)[:, num_decode:]
        if groups == 1:
            return restore_snapshots(caches, prefill_slots[0], restore_ids)
        specs = cache_specs(self.cfg, snapshots=self.blocks.num_snapshots > 0, groups=groups)
        return jax.shard_map(
            lambda caches, slots, ids: restore_snapshots(caches, slots[0], ids[0]),
            mesh=self._mesh,
            in_specs=(specs, P(DP), P(DP)),
            out_specs=specs,
            check_vma=False,
        )(caches, prefill_slots, restore_ids.reshape(groups, -1))

    def _sample(
        self,
        logits,
        slot_tokens,
        slot_ids,
        temperature,
        top_k,
        top_p,
        seeds,
        counters,
        *,
        draws,
        restricts,
    ):
        """The next token of every row of ``logits[R, V]``, and ``slot_tokens`` with it:
        ``(next_tokens[R], slot_tokens[S])``. The settings are per row
        (``serving.sampling.sampling_arrays``); ``draws`` and ``restricts`` are theirs
        (``sampler_flags``)."""
        self.compile_count += 1
        # A key per row from its request's seed and token counter, as data: no program per
        # seed or step, and no dependence on the row's neighbours.
        keys = request_keys(seeds, counters)
        next_tokens = sample_tokens(
            logits, keys, temperature, top_k, top_p, draws=draws, restricts=restricts
        )
        return next_tokens, _with_samples(slot_tokens, slot_ids, next_tokens)

    def _run(
        self,
        arrays: StepArrays,
        sampling: dict[str, np.ndarray] | None = None,
        *,
        restore_ids: np.ndarray | None = None,
        snapshots: StateSnapshots | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """Launches one built step and its sampling: ``(logits[R, V], tokens[R])``, on the
        device and not waited for (``R`` sequence rows, padding included). ``sampling``:
        the rows' settings from ``sampling_arrays`` (None: greedy). Every live row's slot
        gets the pages its keys need first. With prefix caching: ``restore_ids[R - G ·
        num_decode]`` (each group's prefill rows, group-local entries) and ``snapshots``
        (``_snapshot_plan``), none by default."""
        rows = arrays.slot_ids.shape[0]
        if sampling is None:
            sampling = sampling_arrays([None] * rows, [0] * rows)
        kv_lens = arrays.num_computed_tokens + arrays.query_lens
        for slot, kv_len in zip(arrays.slot_ids.tolist(), kv_lens.tolist(), strict=True):
            if slot >= 0:
                self.blocks.ensure(slot, kv_len)
        if self.prefix_caching:
            if restore_ids is None:
                restore_ids = np.full(rows - arrays.groups * arrays.num_decode, -1, np.int32)
            if snapshots is None:
                snapshots = self._snapshot_plan(arrays, [], [])[0]
        draws, restricts = sampler_flags(sampling, self.cfg.vocab_size)
        try:
            logits, self.caches, tokens, self._slot_tokens = self._program(arrays)(
                self._param_leaves,
                self.caches,
                self._slot_tokens,
                arrays.tokens,
                arrays.query_start_loc,
                arrays.num_computed_tokens,
                arrays.slot_ids,
                self._device_tables(),
                restore_ids,
                snapshots,
                num_decode=arrays.num_decode,
            )
            if draws:  # else the step's argmax is every row's token
                tokens = self._launch_sampler(logits, arrays.slot_ids, sampling, draws, restricts)
        except BaseException:
            self._recover_caches()
            raise
        return logits, tokens

    def _program(self, arrays: StepArrays) -> Callable:
        """The jitted step for ``arrays``: the plain one, or one compiled with the XLA
        options of its rows a device (``step_compiler_options``)."""
        options = step_compiler_options(self._mesh, arrays.tokens.shape[0] // arrays.groups)
        if not options:
            return self._jitted
        key = tuple(sorted(options.items()))
        if key not in self._tuned:
            self._tuned[key] = self._jit_step(options)
        return self._tuned[key]

    def _jit_step(self, compiler_options: dict[str, Any] | None = None) -> Callable:
        """``_step`` under ``jax.jit`` (the caches and slot tokens donated), with XLA's
        ``compiler_options`` if any: every jit of the step is made here alike."""
        return jax.jit(
            self._step,
            static_argnames=("num_decode",),
            donate_argnums=(1, 2),
            compiler_options=compiler_options,
        )

    def _launch_sampler(
        self,
        logits: jax.Array,
        slot_ids: np.ndarray,
        sampling: dict[str, np.ndarray],
        draws: bool,
        restricts: bool,
    ) -> jax.Array:
        """Launches the sampler on a step's logits; its tokens (on the device)."""
        tokens, self._slot_tokens = self._sampler(
            logits,
            self._slot_tokens,
            slot_ids,
            sampling["temperature"],
            sampling["top_k"],
            sampling["top_p"],
            sampling["seeds"],
            sampling["counters"],
            draws=draws,
            restricts=restricts,
        )
        return tokens

    def _zero_slot_tokens(self) -> jax.Array:
        """Each slot's last sampled token, zeros: ``[G, S/G]`` int32, each slot group's
        row on the group's devices (split over dp)."""
        groups = self.builder.groups
        zeros = np.zeros((groups, self.builder.slots_per_group), np.int32)
        if groups == 1:
            return self._device_array(zeros)
        split = jax.sharding.NamedSharding(self._mesh, P(DP))
        return jax.make_array_from_callback(zeros.shape, split, lambda index: zeros[index])

    def _device_array(self, array: np.ndarray) -> jax.Array:
        """``array`` on the device, replicated over the model's mesh when it has one."""
        if self._mesh is None:  # (jnp.asarray would compile a program per shape)
            return jax.device_put(array)
        replicated = jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())
        if jax.process_count() > 1:
            # Every process holds the same host array, the whole of a replicated one.
            # device_put onto a mesh spanning other processes' devices costs 1.75 ms a call
            # (two CPU processes, measured), this 0.03 ms.
            return jax.make_array_from_process_local_data(replicated, array)
        return jax.device_put(array, replicated)

    def _device_tables(self) -> jax.Array:
        """``blocks.tables`` on the device, copied when it changed."""
        if self._tables_version != self.blocks.version:
            self._tables = self._device_array(self.blocks.tables.copy())
            self._tables_version = self.blocks.version
        return self._tables

    def _snapshot_capacity(self, num_decode: int, token_bucket: int) -> tuple[int, int]:
        """Static numbers of decode and prefill snapshot saves of a step's bucket. Prefill:
        a sequence of n new tokens crosses at most ``n // block_size + 1`` block ends, each
        needing a token, so every save fits. Decode: each save gathers a row's states (4
        MB per Mamba layer on Bamba-9B), so a step takes a few (rows end blocks one token
        in a block size apart); rows past them publish their block without a snapshot."""
        prefill = 0
        if token_bucket:
            prefill = min(token_bucket, token_bucket // self.block_size + self.builder.prefill_seqs)
        return min(num_decode, _DECODE_SAVES), prefill

    def _snapshot_plan(
        self,
        arrays: StepArrays,
        decode: list[_Sequence],
        prefill: list[tuple[_Sequence, int]],
    ) -> tuple[StateSnapshots, dict[int, dict[int, int]]]:
        """Which block ends of this step save their Mamba states, into which snapshot
        entries: ``(StateSnapshots, {sequence index: {block: entry}})``. A block end is
        saved when prefix caching wants it (``BlockManager.wants_snapshot``) and an entry
        is free or evictable. With G slot groups each group saves into its own pool, up
        to the bucket's capacity each: the columns are the groups' one after another,
        with rows and entries local to the group (``taken`` holds global entries)."""
        bs, num_decode, groups = self.block_size, arrays.num_decode, arrays.groups
        group_rows = arrays.slot_ids.shape[0] // groups
        decode_capacity, capacity = self._snapshot_capacity(*arrays.bucket)
        # Per group: (decode row, entry) and (prefill sequence, position, entry).
        decode_saves: list[list[tuple[int, int]]] = [[] for _ in range(groups)]
        saves: list[list[tuple[int, int, int]]] = [[] for _ in range(groups)]
        taken: dict[int, dict[int, int]] = {}
        fed = [(s, 1) for s in decode] + list(prefill)
        for (seq, count), row in zip(fed, arrays.rows if fed else [], strict=True):
            start = seq.num_computed
            ends = range((start // bs + 1) * bs, start + count + 1, bs)
            if not ends or not self.blocks.num_snapshots:
                continue
            group, local_row = divmod(int(row), group_rows)
            blocks = self._block_groups[group]
            tokens = seq.tokens()
            block_keys(tokens, bs, (start + count) // bs, seq.keys)
            for end in ends:
                block = end // bs - 1
                full = (
                    len(saves[group]) == capacity
                    if local_row >= num_decode
                    else (len(decode_saves[group]) == decode_capacity)
                )
                if full:
                    break
                if not blocks.wants_snapshot(seq.keys, block):
                    continue
                entry = blocks.take_snapshot()
                if entry is None:
                    break
                taken.setdefault(seq.index, {})[block] = self._grouped.global_snapshot(group, entry)
                if local_row < num_decode:
                    decode_saves[group].append((local_row, entry))
                else:
                    saves[group].append((local_row - num_decode, end, entry))
        # Padding saves nothing.
        decode_columns = np.full((2, groups, decode_capacity), -1, np.int32)
        columns = np.full((3, groups, capacity), -1, np.int32)
        for group in range(groups):
            if decode_saves[group]:
                chosen = np.asarray(decode_saves[group], np.int32).T
                decode_columns[:, group, : chosen.shape[1]] = chosen
            if saves[group]:
                chosen = np.asarray(saves[group], np.int32).T
                columns[:, group, : chosen.shape[1]] = chosen
        return StateSnapshots(*decode_columns.reshape(2, -1), *columns.reshape(3, -1)), taken

    def _recover_caches(self) -> None:
        """After a step that raised: the caches were donated to it, and if it consumed them
        (an interrupt or a device error after dispatch) fresh zero caches replace them, so
        the engine stays usable. Slots' states are lost then, which is harmless for slots
        given back, since a new sequence never reads its slot's old state; every page and
        the prefix cache are dropped with them."""
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.caches)):
            self.caches = self._init_cache()
            self.blocks.reset()
        if self._slot_tokens.is_deleted():
            self._slot_tokens = self._zero_slot_tokens()

    def _count(
        self,
        arrays: StepArrays,
        seconds: float,
        decode_tokens: int | None = None,
        prefill_tokens: int | None = None,
    ) -> None:
        """Adds a step served in ``seconds`` to ``stats`` and ``step_buckets``: its decode
        rows and prompt tokens (those of the built step by default; ``stream`` leaves out
        rows of sequences that ended in the step before, launched ahead of their end)."""
        if decode_tokens is None:
            decode_tokens = arrays.num_decode_requests
            prefill_tokens = arrays.num_tokens - decode_tokens
        # A mixed step runs decode rows and prompt tokens through the same program; every
        # token costs about the same in the projections, which dominate, so the step's time
        # is shared in proportion to the tokens it computed.
        self.stats["decode_tokens"] += decode_tokens
        self.stats["prefill_tokens"] += prefill_tokens
        self.stats["decode_seconds"] += seconds * decode_tokens / arrays.num_tokens
        self.stats["prefill_seconds"] += seconds * prefill_tokens / arrays.num_tokens
        self.step_buckets[arrays.bucket] += 1

    def step(self, arrays: StepArrays, *, wait: bool = True) -> jax.Array:
        """Runs one built step; returns the last-token logits of every sequence row,
        ``[R, V]`` fp32, on the device (a 256-row step's logits are 128 MiB at V = 128k:
        copying them to the host would take longer than the step; sample on the device).

        ``wait=False`` returns once the step is launched, without counting it in ``stats``:
        for callers that chain steps (a decode row's token may be ``FROM_DEVICE``, the one
        its slot sampled in the step before), as ``stream`` does."""
        start = time.perf_counter()
        logits, tokens = self._run(arrays)
        if wait:
            jax.block_until_ready((logits, tokens))
            if arrays.num_requests:
                self._count(arrays, time.perf_counter() - start)
        return logits

    def warmup(self) -> int:
        """Compiles every program a generation can use: a step per bucket (greedy tokens
        included) and the sampler's two per count of rows (all-padding steps change no
        cache); returns the count."""
        warmed = set()
        for num_decode, token_bucket in self.builder.buckets():
            arrays = self.builder.dummy(num_decode, token_bucket)
            logits, tokens = self._run(arrays)
            rows = arrays.slot_ids.shape[0]
            if rows not in warmed:
                warmed.add(rows)
                sampling = sampling_arrays([None] * rows, [0] * rows)
                for restricts in (False, True):  # drawing, without and with a cutoff
                    tokens = self._launch_sampler(
                        logits, arrays.slot_ids, sampling, True, restricts
                    )
            jax.block_until_ready(tokens)
        return self.compile_count

    # ------------------------------------------------------------------------ slots

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError("no free cache slot")
        return self._free_slots.pop()

    def release_slot(self, slot: int) -> None:
        """Frees a slot and its KV pages. Its stale state is never read: the next sequence
        there starts with num_computed = 0 (no initial conv/SSM state) or from a restored
        snapshot, and kv_lens bound its attention."""
        if slot in self._free_slots or not 0 <= slot < self.builder.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self.blocks.release(slot)
        self._free_slots.append(slot)

    def clear_prefix_cache(self) -> None:
        """Forgets every cached prefix (between generations): later prompts compute from
        their first token until blocks are published again."""
        self.blocks.clear_cache()

    def use_prefix_cache(self, enabled: bool) -> None:
        """Switches lookups and publishing on or off (between generations) in an engine
        built with ``prefix_caching=True``, on the same compiled programs (A/B
        measurements of the lookups). Off, every prompt is computed whole and nothing is
        published or saved, but the steps stay those of a caching engine: the Mamba prefill
        still runs the snapshot path (the scan keeps every chunk's state, and the
        snapshot gathers and scatters run, writing no entry), and the caches keep their
        snapshot pools. So off is not an engine built without ``prefix_caching``, whose
        prefill is the plain scan."""
        if not self.prefix_caching:
            raise ValueError("use_prefix_cache needs an engine built with prefix_caching=True")
        self.clear_prefix_cache()
        self.blocks.prefix_caching = bool(enabled)

    # ------------------------------------------------------------------------ generate

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
        max_new_tokens: int | None = None,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        eos_id: int | Iterable[int] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool | None = None,
    ) -> list[list[int]]:
        """Generates up to ``max_new_tokens`` (16 when None) per prompt; the new tokens only,
        one list per prompt, in prompt order.

        Greedy at ``temperature=0``; otherwise samples from the softmax of
        ``logits / temperature`` over the ``top_k`` largest and then the ``top_p`` nucleus
        (all when None), with keys from ``seed`` (an int in ``[0, 2**32)``). These settings
        are those of ``SamplingParams``; ``sampling=`` gives them as one ``SamplingParams``
        or one per prompt (then leave the keywords alone). A sequence ends at
        ``max_new_tokens`` or at a token of ``eos_id`` (one id or several) or of its
        ``stop_token_ids`` (kept as its last token).

        ``prompts`` is a list of prompts, each a list, NumPy or JAX array of int token ids
        in ``[0, vocab_size)``, or a 2-D int array (one prompt per row). Every argument and
        prompt is checked before any slot or cache is touched; the slots taken come back
        however the call ends (an error, an interrupt), so the engine stays usable. No
        prompts or ``max_new_tokens=0`` give empty results.
        """
        if sampling is None:
            sampling = SamplingParams(
                max_new_tokens=16 if max_new_tokens is None else max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
            )
        elif max_new_tokens is not None or (temperature, top_k, top_p, seed) != (0, None, None, 0):
            raise ValueError(
                "give the sampling settings either as sampling= or as keywords, not both"
            )
        events = self.stream(prompts, sampling, eos_ids=eos_id, progress=progress)
        generated: list[list[int]] = [[] for _ in range(events.num_requests)]
        for event in events:
            generated[event.index].append(event.token)
        return generated

    def stream(
        self,
        prompts: Sequence[Sequence[int]] | np.ndarray | jax.Array,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        eos_ids: int | Iterable[int] | None = None,
        stop: Callable[[int, int], bool] | None = None,
        progress: bool | None = None,
    ) -> _EventStream:
        """Generates like ``generate``, yielding each token as it is drawn: ``TokenEvent(index,
        token, finish_reason)``, in the order the steps produce them (a request's own
        tokens in order). ``sampling``: one ``SamplingParams`` for every prompt, one per
        prompt, or None for the defaults.

        ``stop(index, token)``, when given, is called on the host after each generated token
        that is not a stop token; True ends that request there (``finish_reason="stop"``):
        how the text layer stops at stop strings. Everything is checked here, before the
        first step; stopping the iteration early (``close()``, a ``break``) gives the slots
        back.
        """
        prompts = self._check_prompts(prompts)
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or SamplingParams()] * len(prompts)
        else:
            params = list(sampling)
            if len(params) != len(prompts):
                raise ValueError(
                    f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, or "
                    "one per prompt"
                )
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling {i} is a {type(p).__name__}, not SamplingParams")
        if eos_ids is None:
            eos_ids = ()
        elif isinstance(eos_ids, numbers.Integral):
            eos_ids = (eos_ids,)
        eos = frozenset(check_int("eos_id", t) for t in eos_ids)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            if len(prompt) + p.max_new_tokens > self.builder.max_len:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} tokens + {p.max_new_tokens} new "
                    f"exceed max_len={self.builder.max_len}"
                )
            pages = -(-(len(prompt) + p.max_new_tokens - 1) // self.block_size)
            pool = self._block_groups[0].num_pages  # a sequence's pages are its group's
            if pages > pool:
                where = "" if self.builder.groups == 1 else f" / dp={self.builder.groups}"
                raise ValueError(
                    f"prompt {i}: {len(prompt)} tokens + {p.max_new_tokens} new need {pages} "
                    f"KV pages of {self.block_size} tokens; num_kv_blocks="
                    f"{self.blocks.num_pages}{where}"
                )
        sequences = [
            _Sequence(i, prompt, p, eos | frozenset(p.stop_token_ids))
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        ]
        hits: dict[int, int] = {}
        return _EventStream(self._schedule(sequences, stop, progress, hits), len(prompts), hits)

    def _schedule(
        self,
        sequences: list[_Sequence],
        stop: Callable[[int, int], bool] | None,
        progress: bool | None,
        hits: dict[int, int],
    ) -> Iterator[TokenEvent]:
        """The scheduler loop of ``stream`` over checked requests; ``hits`` gets each
        request's prefix hit tokens as it is admitted.

        It runs one step ahead: step n + 1 is planned and launched (its decode rows fed
        from the device) before the host reads step n's tokens, so the host's work for a
        step (reading tokens, events, planning, launching) hides behind the device's.
        Step n + 1 assumes every sequence of step n goes on; one that ends there (an eos or
        stop token, ``stop``) has its row of step n + 1 discarded, which is harmless: its
        slot's states are never read again, and its KV pages are rewritten before they
        are read by whoever takes them next (steps run in launch order). Where the plan
        would depend on step n's tokens (a prefix-caching state save at a block end of a
        row fed from the device, or an admission with prefix caching, which must see the
        blocks step n publishes), step n is read first."""
        waiting = collections.deque(s for s in sequences if s.params.max_new_tokens > 0)
        if not waiting:
            return
        running: list[_Sequence] = []
        bar = _Progress(sum(s.params.max_new_tokens for s in waiting), enabled=progress)
        # Every slot this call takes is back in the free list when it returns or raises
        # (however far it got): the free list is restored as it was on entry, and the
        # pages of the sequences still running are given back.
        free_on_entry = list(self._free_slots)
        for slot in free_on_entry:  # pages direct ``step`` calls left in free slots
            self.blocks.release(slot)
        pending: _Launched | None = None  # launched, tokens not read yet
        launched: _Launched | None = None
        try:
            while waiting or running:
                launched = self._launch_next(waiting, running, hits, ahead=pending is not None)
                if pending is not None:
                    yield from self._land(pending, running, stop, bar)
                elif launched is None:  # nothing runs, so nothing will ever free
                    raise RuntimeError(self._stall_reason(waiting[0]))
                pending, launched = launched, None
        finally:
            for step in (pending, launched):
                if step is not None:  # snapshot entries of steps never read
                    self.blocks.give_back_snapshots(
                        [e for t in step.taken.values() for e in t.values()]
                    )
            for seq in running:
                self.blocks.release(seq.slot)
            self._free_slots = free_on_entry
            bar.close()

    def _stall_reason(self, seq: _Sequence) -> str:
        """Why ``seq`` can never be admitted with nothing running: slots or pages held by
        ``allocate_slot`` and direct ``step`` calls outside the generation."""
        held = self.builder.num_slots - len(self._free_slots)
        if not self._free_slots:
            return (
                f"request {seq.index} waits for a cache slot, but all {held} are held outside "
                "generate (allocate_slot); release_slot() them first"
            )
        return (
            f"request {seq.index} needs KV pages for {len(seq.prompt)} + "
            f"{seq.params.max_new_tokens} tokens, but {held} slots held outside generate "
            f"(allocate_slot and step) keep the pool's other pages; release_slot() them first"
        )

    def _launch_next(
        self,
        waiting: collections.deque[_Sequence],
        running: list[_Sequence],
        hits: dict[int, int],
        *,
        ahead: bool,
    ) -> _Launched | None:
        """Admits what fits, then plans and launches the next step: decode rows for the
        sequences whose prompt is done, prompt chunks within the token budget. ``ahead``: a
        step is in flight whose tokens the host has not read; None (nothing launched) when
        the plan would depend on them, or when nothing is left to run."""
        bs = self.block_size
        if not (ahead and self.prefix_caching):  # see _schedule: admissions must wait
            while waiting and self._free_slots:
                seq = self._next_admissible(waiting, running)
                if seq is None or not self._admit(seq):
                    break  # waits for pages (first come, first served)
                waiting.remove(seq)
                running.append(seq)
                hits[seq.index] = seq.num_computed
        # Sequences whose last token is in flight end there by length: nothing to plan.
        live = [s for s in running if s.num_generated < s.params.max_new_tokens]
        decode = [s for s in live if s.prompt_done]
        if (
            ahead
            and self.blocks.num_snapshots
            and any(s.in_flight and (s.num_computed + 1) % bs == 0 for s in decode)
        ):
            return None  # a state save at a block end needs the block's tokens
        # Each slot group's budget: its decode rows count against it.
        budgets = [self.token_budget] * self.builder.groups
        for seq in decode:
            budgets[self._group(seq.slot)] -= 1
        budgets = [max(b, 0) for b in budgets]
        prefill: list[tuple[_Sequence, int]] = []
        for seq in live:
            group = self._group(seq.slot)
            if not seq.prompt_done and budgets[group]:
                count = min(len(seq.prompt) - seq.num_computed, budgets[group])
                prefill.append((seq, count))
                budgets[group] -= count
        if not decode and not prefill:
            return None
        arrays = self.builder.build(
            [
                Request(s.slot, [FROM_DEVICE if s.in_flight else s.generated[-1]], s.num_computed)
                for s in decode
            ],
            [
                Request(s.slot, s.prompt[s.num_computed : s.num_computed + n], s.num_computed)
                for s, n in prefill
            ],
        )
        fed = [(s, 1) for s in decode] + prefill
        rows = self.builder.request_rows(arrays)
        restore_ids, snapshots, taken = None, None, {}
        if self.prefix_caching:
            snapshots, taken = self._snapshot_plan(arrays, decode, prefill)
            group_rows = len(arrays.slot_ids) // arrays.groups
            restore_ids = np.full((arrays.groups, group_rows - arrays.num_decode), -1, np.int32)
            for seq, row in zip([s for s, _ in fed], rows, strict=True):
                if seq.restore is not None:  # a prefill row, its first computed step
                    group, local_row = divmod(int(row), group_rows)
                    _, local_entry = self._grouped.local_snapshot(seq.restore)
                    restore_ids[group, local_row - arrays.num_decode] = local_entry
            restore_ids = restore_ids.reshape(-1)
        # Each row samples with its request's settings and key; rows whose token is not
        # used (a prompt not done after this step, padding) take the argmax.
        row_params: list[SamplingParams | None] = [None] * arrays.slot_ids.shape[0]
        counters = [0] * len(row_params)
        samples = []
        for (seq, count), row in zip(fed, rows, strict=True):
            samples.append(seq.num_computed + count >= len(seq.prompt))
            if samples[-1]:
                row_params[row] = seq.params
                counters[row] = seq.num_generated
        launched_at = time.perf_counter()
        try:
            _, tokens = self._run(
                arrays,
                sampling_arrays(row_params, counters),
                restore_ids=restore_ids,
                snapshots=snapshots,
            )
        except BaseException:
            self.blocks.give_back_snapshots([e for t in taken.values() for e in t.values()])
            raise
        # The host's view moves on at launch: what the step computes does not depend on
        # its tokens; what it samples is counted in flight until it is read.
        entries = []
        for (seq, count), sampled in zip(fed, samples, strict=True):
            entries.append(_Fed(seq, seq.num_computed, count, sampled, seq.restore is not None))
            seq.num_computed += count
            seq.restore = None
            seq.in_flight += sampled
        return _Launched(arrays, entries, rows, tokens, taken, launched_at)

    def _land(
        self,
        step: _Launched,
        running: list[_Sequence],
        stop: Callable[[int, int], bool] | None,
        bar: _Progress,
    ) -> Iterator[TokenEvent]:
        """Reads a launched step's tokens (waiting for it), does its bookkeeping and yields
        its events; rows of sequences that ended before it are discarded."""
        tokens = np.asarray(step.tokens)
        now = time.perf_counter()
        kept = [f for f in step.fed if not f.seq.ended]
        num_decode = step.arrays.num_decode_requests  # the first entries are decode rows
        self._count(
            step.arrays,
            # The device ran the step after the one before it ended (or after its launch).
            now - max(step.launched_at, self._clock),
            decode_tokens=sum(not f.seq.ended for f in step.fed[:num_decode]),
            prefill_tokens=sum(f.count for f in step.fed[num_decode:]),
        )
        self._clock = now
        # Every kept sequence's bookkeeping (restore, and the blocks and snapshots of this
        # step) is done before the first event is yielded: the consumer may stop at any
        # yield (close(), break, an exception in ``stop``), and no snapshot taken for this
        # step may be left unpublished.
        for f in kept:
            if f.restored:
                self.blocks.restored(f.seq.slot)
            if self.blocks.prefix_caching:
                self._publish(f.seq, f.start, f.start + f.count, step.taken.pop(f.seq.index, {}))
        self.blocks.give_back_snapshots([e for t in step.taken.values() for e in t.values()])
        step.taken.clear()
        for f, row in zip(step.fed, step.rows, strict=True):
            seq = f.seq
            if seq.ended or not f.samples:
                continue
            token = int(tokens[row])
            seq.in_flight -= 1
            seq.generated.append(token)
            bar.advance()
            if token in seq.stop_ids or (stop is not None and stop(seq.index, token)):
                reason = "stop"
            elif len(seq.generated) == seq.params.max_new_tokens:
                reason = "length"
            else:
                reason = None
            if reason is not None:
                seq.ended = True
                running.remove(seq)
                self.release_slot(seq.slot)
            yield TokenEvent(seq.index, token, reason)

    def _next_admissible(
        self, waiting: collections.deque[_Sequence], running: list[_Sequence]
    ) -> _Sequence | None:
        """The first waiting request that need not wait for a prefix in flight.

        With prefix caching, a request whose next uncached block is one a running prompt
        is computing now waits for it to be published rather than computing it again
        (many requests arriving together with one system prompt compute it once); later
        requests pass it. The running prompt publishes its blocks as its chunks complete,
        so the wait ends at the latest when its prefill does."""
        if not self.blocks.prefix_caching:
            return waiting[0]
        bs = self.block_size
        in_flight = {
            key
            for r in running
            if not r.prompt_done
            for key in r.keys[r.num_computed // bs : len(r.prompt) // bs]
        }
        for seq in waiting:
            usable = (len(seq.prompt) - 1) // bs  # seq.keys may hold more (a failed admit)
            keys = block_keys(seq.prompt, bs, usable, seq.keys)[:usable]
            hit = max(blocks.lookup(seq.prompt, keys)[0] for blocks in self._block_groups)
            if hit == len(keys) or keys[hit] not in in_flight:
                return seq
        return None

    def _group(self, slot: int) -> int:
        """The slot group of ``slot`` (0 without dp groups)."""
        return slot // self.builder.slots_per_group

    def _slot_choices(self, seq: _Sequence) -> list[int]:
        """A free slot of each slot group that has one, in the order admission tries them
        for ``seq``: the group with the longest prefix hit first (prefix caching), then the
        most free slots, then the most free pages."""
        first: dict[int, int] = {}  # group -> its free slot allocate_slot would give first
        free = [0] * self.builder.groups
        for slot in reversed(self._free_slots):
            group = self._group(slot)
            first.setdefault(group, slot)
            free[group] += 1
        if len(first) == 1:
            return list(first.values())

        def preference(group: int) -> tuple[int, ...]:
            blocks = self._block_groups[group]
            hit = blocks.lookup(seq.prompt, seq.keys)[0] if self.prefix_caching else 0
            return -hit, -free[group], -blocks.num_free_pages, group

        return [first[g] for g in sorted(first, key=preference)]

    def _admit(self, seq: _Sequence) -> bool:
        """Gives ``seq`` a slot, its cached prefix (prefix caching) and its page
        reservation; False (nothing changed) when no slot group's pool can hold them yet."""
        if self.prefix_caching:  # every full prompt block's key: in flight once admitted
            block_keys(seq.prompt, self.block_size, len(seq.prompt) // self.block_size, seq.keys)
        for slot in self._slot_choices(seq):
            hit = self.blocks.admit(
                slot, seq.prompt, seq.keys, len(seq.prompt) + seq.params.max_new_tokens - 1
            )
            if hit is not None:
                break
        else:
            return False
        self._free_slots.remove(slot)
        seq.slot = slot
        seq.num_computed, seq.restore = hit.tokens, hit.snapshot
        if self.prefix_caching:
            self.stats["prefix_hit_tokens"] += hit.tokens
            self.stats["prefix_hits" if hit.tokens else "prefix_misses"] += 1
        return True

    def _publish(self, seq: _Sequence, start: int, stop: int, snapshots: dict[int, int]) -> None:
        """Publishes the blocks ``seq`` filled in a step that took it from ``start`` to
        ``stop`` computed tokens, with the snapshots saved at their ends."""
        first, end = start // self.block_size, stop // self.block_size
        if end > first:
            tokens = seq.tokens()
            block_keys(tokens, self.block_size, end, seq.keys)
            self.blocks.publish(seq.slot, tokens, seq.keys, range(first, end), snapshots)
        elif snapshots:
            self.blocks.give_back_snapshots(list(snapshots.values()))

    def _check_prompts(self, prompts) -> list[list[int]]:
        """Prompts as lists of ints in ``[0, vocab_size)``; ``ValueError`` naming the first
        bad one. A prompt is a list of ints or a 1-D NumPy/JAX integer array; ``prompts``
        is a list of them or a 2-D integer array."""
        if isinstance(prompts, str | bytes):
            raise ValueError("prompts must be a list of token-id lists, not a string")
        if hasattr(prompts, "__array__") and not isinstance(prompts, list | tuple):
            prompts = np.asarray(prompts)
            if prompts.ndim == 1:
                raise ValueError(
                    f"prompts is a flat array of {prompts.shape[0]} token ids; pass a list of "
                    "prompts or a 2-D array [prompts, tokens], e.g. [ids]"
                )
            if prompts.ndim != 2:
                raise ValueError(
                    f"a prompts array must be 2-D [prompts, tokens], got shape {prompts.shape}"
                )
            prompts = list(prompts)
        try:
            prompts = list(prompts)
        except TypeError:
            raise ValueError(
                f"prompts must be a list of token-id lists, got {reprlib.repr(prompts)}"
            ) from None
        if prompts and all(_is_token(p) for p in prompts):
            raise ValueError(
                f"prompts={reprlib.repr(prompts)} is a flat list of token ids; pass a list of "
                "prompts, e.g. [[1, 2, 3]]"
            )
        vocab = self.cfg.vocab_size
        checked = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str | bytes):
                raise ValueError(f"prompt {i} is a string; a prompt is a list of int token ids")
            ids = _token_ids(prompt)
            if ids is None:
                raise ValueError(
                    f"prompt {i} must be a list or 1-D array of int token ids (not floats or "
                    f"bools), got {reprlib.repr(prompt)}"
                )
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            for position, token in enumerate(ids):
                if not 0 <= token < vocab:
                    raise ValueError(
                        f"prompt {i}: token id {token} at position {position} is outside "
                        f"[0, vocab_size={vocab})"
                    )
            checked.append(ids)
        return checked


class _EventStream:
    """The iterator ``Engine.stream`` returns: its ``TokenEvent``s, ``num_requests``, and
    ``prefix_hits`` (request index -> prompt tokens taken from the prefix cache, filled as
    requests are admitted; 0 without prefix caching)."""

    def __init__(
        self, events: Iterator[TokenEvent], num_requests: int, prefix_hits: dict[int, int]
    ):
        self._events, self.num_requests, self.prefix_hits = events, num_requests, prefix_hits

    def __iter__(self) -> _EventStream:
        return self

    def __next__(self) -> TokenEvent:
        return next(self._events)

    def close(self) -> None:
        """Stops the generation; its slots go back to the engine."""
        self._events.close()


def _is_token(value: object) -> bool:
    """An int-like scalar (a Python, NumPy or 0-d array integer), not a prompt."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Integral):
        return True
    return getattr(value, "ndim", None) == 0


def _token_ids(prompt: object) -> list[int] | None:
    """``prompt`` as a list of ints, or None when it is not a sequence of integer ids
    (floats, bools, nested lists and scalars are refused)."""
    if hasattr(prompt, "__array__") and not isinstance(prompt, list | tuple):
        array = np.asarray(prompt)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            return None
        return [int(t) for t in array.tolist()]
    ids = []
    try:
        for token in prompt:
            if isinstance(token, bool | np.bool_):  # an int to Python, never a token id
                return None
            if hasattr(token, "dtype") and np.dtype(token.dtype).kind not in "iu":
                return None
            ids.append(operator.index(token))
    except TypeError:
        return None
    return ids


class _Progress:
    """A one-line progress bar on stderr for long generations (auto: TTY and ≥ 256 tokens)."""

    def __init__(self, total: int, *, enabled: bool | None):
        if enabled is None:
            enabled = total >= 256 and sys.stderr.isatty()
        self.total, self.done, self.enabled = total, 0, enabled

    def advance(self) -> None:
        self.done += 1
        if self.enabled and (self.done % 16 == 0 or self.done == self.total):
            filled = 30 * self.done // max(self.total, 1)
            sys.stderr.write(
                f"\rgenerate [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} tokens"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
