"""The step programs of the engine: the jitted step over the slot-indexed caches, the
device sampler after it, and the device arrays they run on.

A step is one program per bucket (``jax.jit`` with the caches and slot tokens donated, so
they are updated in place). It takes the argmax of its logits, which is all a greedy step
needs; a step where some row draws runs a sampler program after it, with each row's
temperature, top-k, top-p, seed and token counter as data (two programs per count of rows:
drawing, and drawing with top-k/top-p). Nothing in either waits on the host, so the engine
can launch step n + 1 before it reads step n's tokens: a decode row whose token is
``FROM_DEVICE`` is fed from the token its slot sampled last, kept on the device.

On a mesh with a ``"dp"`` axis the step's arrays are the slot groups' one after another;
each group runs on its own devices and share of the caches (``flax_models.sharding``).
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from flax_models.batch import StateSnapshots, make_forward_batch, make_grouped_forward_batch
from flax_models.cache import cache_specs, init_cache, restore_snapshots
from flax_models.model import HybridLM
from flax_models.serving.batching import FROM_DEVICE, BatchBuilder, StepArrays
from flax_models.serving.executables import ExecutableCache, canonical
from flax_models.serving.prefix_cache import BlockManager, GroupedBlockManager
from flax_models.serving.sampling import (
    MAX_LOGPROBS,
    greedy_tokens,
    request_keys,
    sample_tokens,
    sampler_flags,
    sampling_arrays,
)
from flax_models.sharding import DP, step_compiler_options

__all__ = ["StepRunner"]


# Steps of at least this many token rows a device compile without Triton gemms: XLA then
# picks among cuBLAS's algorithms only. On one H200 (Bamba-9B shape, 2026-12-03, eight
# programs compiled at once) such steps compiled in a half to two thirds of the time
# (12.7-17.8 s against 19.6-23.8 s with 1024-8192 prompt tokens, 2.9 against 6.7-7.5 s for
# 32 and 256 decode rows) and ran faster (32 decode rows 6.93 against 7.21 ms, 256 rows
# 9.69 against 10.39, 8192 prompt tokens 210.3 against 212.8); one decode row ran 1% slower
# (6.46 against 6.39 ms), and 2-16 rows were not measured, so smaller steps keep XLA's
# default. Steps under tp were not measured either way.
CUBLAS_ONLY_MIN_ROWS = 32


def step_xla_options(mesh: jax.sharding.Mesh | None, rows: int) -> dict[str, Any]:
    """XLA's options for an engine step over ``mesh`` with ``rows`` token rows a device:
    ``step_compiler_options`` (the split-K rewrite under tp) and, from
    ``CUBLAS_ONLY_MIN_ROWS`` rows, no Triton gemms. On a CPU the options are accepted and
    change nothing."""
    options = step_compiler_options(mesh, rows)
    if rows >= CUBLAS_ONLY_MIN_ROWS:
        options = options | {"xla_gpu_enable_triton_gemm": False}
    return options


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


class StepRunner:
    """Runs built steps of ``model`` over its caches.

    Attributes:
      caches: the slot-indexed caches (conv/SSM states, KV page pools, snapshot pools).
      compile_count: programs compiled: one per step bucket (its greedy tokens included) and
        the sampler's two per count of sequence rows.
      step_program: the jitted step (``jax.jit`` of ``step_function``), as called for the
        steps XLA compiles without options of their own.
      executable_cache: where compiled step programs are kept across processes (None:
        nowhere); ``loaded_count`` the step programs loaded from it.
      ssm_cache_dtype: the dtype of the SSM state cache and its snapshots.
    """

    def __init__(
        self,
        model: HybridLM,
        builder: BatchBuilder,
        blocks: BlockManager | GroupedBlockManager,
        executable_cache: ExecutableCache | None = None,
        ssm_cache_dtype: jnp.dtype = jnp.float32,
    ):
        self.cfg = model.cfg
        self.builder = builder
        self.blocks = blocks  # the page tables and pools the caches are laid out for
        self._cache_dtype = model.dtype
        self._ssm_cache_dtype = jnp.dtype(ssm_cache_dtype)
        self._mesh = model.mesh  # a sharded model serves on its mesh, caches split alike
        self.caches = self._init_cache()
        self.compile_count = 0
        self.load_params(model)
        self._tables = None  # the device copy of blocks.tables, and its version
        self._tables_version = -1
        # The token each slot sampled last, on the device: a decode row whose token is
        # ``FROM_DEVICE`` is fed from it, so a step can be launched before the host has read
        # the one before.
        self.slot_tokens = self._zero_slot_tokens()
        self.step_program = self._jit_step()
        # The steps that XLA compiles with options of their own (``step_xla_options``),
        # one jit per set of options; every bucket still compiles once, in one of them.
        self._tuned: dict[tuple, Callable] = {}
        # Drawing is a program of its own, picked on the host: whether a step's rows draw
        # or restrict is host data, and deciding it on the device (a lax.cond) would make
        # the host wait for every step before it could launch the next.
        self.sampler_program = jax.jit(
            self._sample, static_argnames=("draws", "restricts"), donate_argnums=(1,)
        )
        # Log-probabilities are a program of their own too, launched only for steps where
        # some row asks for them.
        self.logprobs_program = jax.jit(self._logprobs)
        # Step programs compiled by ``keep_step`` or loaded by ``load_steps``, by
        # ``_signature``: a launch runs them without tracing the step again.
        self.executable_cache = executable_cache
        self.loaded_count = 0
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        self._missing: dict[tuple, str] = {}  # the keys load_steps found no entry for

    def load_params(self, model: HybridLM) -> None:
        """Takes ``model``'s parameters for the next steps. The parameters travel to every
        step as a flat list of arrays: flattening the nnx.State of a 9B model (hundreds of
        Variables, in Python) on every dispatch cost more host time than the rest of the
        step's launch."""
        self._graphdef, params = nnx.split(model)
        self.param_leaves, self._param_tree = jax.tree.flatten(params)
        self._model_text = None  # the graph definition's text, for executable-cache keys

    def _init_cache(self):
        return init_cache(
            self.cfg,
            num_slots=self.builder.num_slots,
            max_len=self.builder.max_len,
            dtype=self._cache_dtype,
            ssm_dtype=self._ssm_cache_dtype,
            mesh=self._mesh,
            num_blocks=self.blocks.num_pages,
            block_size=self.blocks.block_size,
            num_snapshots=self.blocks.num_snapshots,
            groups=self.builder.groups,
        )

    # ------------------------------------------------------------------------ programs

    def step_function(
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

    def _logprobs(self, logits, tokens):
        """``(logprob of tokens[R], top ids[R, K], top logprobs[R, K])`` of ``logits[R, V]``'s
        fp32 log-softmax, ``K = min(MAX_LOGPROBS, V)``."""
        self.compile_count += 1
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        top_lp, top_ids = jax.lax.top_k(logp, min(MAX_LOGPROBS, logp.shape[-1]))
        sampled = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
        return sampled, top_ids.astype(jnp.int32), top_lp

    def _jit_step(self, compiler_options: dict[str, Any] | None = None) -> Callable:
        """``step_function`` under ``jax.jit`` (the caches and slot tokens donated), with
        XLA's ``compiler_options`` if any: every jit of the step is made here alike."""
        return jax.jit(
            self.step_function,
            static_argnames=("num_decode",),
            donate_argnums=(1, 2),
            compiler_options=compiler_options,
        )

    def program(self, arrays: StepArrays) -> Callable:
        """The jitted step for ``arrays``: the plain one, or one compiled with the XLA
        options of its rows a device (``step_xla_options``)."""
        options = step_xla_options(self._mesh, arrays.tokens.shape[0] // arrays.groups)
        if not options:
            return self.step_program
        key = tuple(sorted(options.items()))
        if key not in self._tuned:
            self._tuned[key] = self._jit_step(options)
        return self._tuned[key]

    def step_arguments(
        self,
        arrays: StepArrays,
        restore_ids: np.ndarray | None = None,
        snapshots: StateSnapshots | None = None,
    ) -> tuple[tuple, dict[str, int]]:
        """The arguments the step program of ``arrays`` takes: ``(args, kwargs)`` (also for
        lowering it, e.g. to read its HLO)."""
        args = (
            self.param_leaves,
            self.caches,
            self.slot_tokens,
            arrays.tokens,
            arrays.query_start_loc,
            arrays.num_computed_tokens,
            arrays.slot_ids,
            self._device_tables(),
            restore_ids,
            snapshots,
        )
        return args, dict(num_decode=arrays.num_decode)

    def lower_step(
        self,
        arrays: StepArrays,
        restore_ids: np.ndarray | None = None,
        snapshots: StateSnapshots | None = None,
    ) -> jax.stages.Lowered:
        """The step program of ``arrays`` traced and lowered, not compiled: its
        ``compile()`` (thread-safe, and releasing the GIL) leaves the executable where the
        program's next call finds it."""
        args, kwargs = self.step_arguments(arrays, restore_ids, snapshots)
        return self.program(arrays).lower(*args, **kwargs)

    @staticmethod
    def _signature(arrays: StepArrays, restore_ids, snapshots) -> tuple:
        """What tells the step programs apart: the step arrays' shapes and dtypes and
        ``num_decode`` (the parameters, caches and tables never change theirs)."""
        steps = (arrays.tokens, arrays.query_start_loc, arrays.num_computed_tokens)
        leaves, tree = jax.tree.flatten((steps, arrays.slot_ids, restore_ids, snapshots))
        shapes = tuple((np.shape(a), np.dtype(getattr(a, "dtype", type(a)))) for a in leaves)
        return shapes, str(tree), arrays.num_decode

    def _cache_key(self, arrays: StepArrays, restore_ids, snapshots) -> str:
        """The executable cache's key of this step program: besides the environment
        (``ExecutableCache.key``), the model's graph definition and every argument's
        shape, dtype and sharding, ``num_decode`` and XLA's options."""
        args, kwargs = self.step_arguments(arrays, restore_ids, snapshots)
        leaves, tree = jax.tree.flatten(args)
        avals = [
            (np.shape(a), str(getattr(a, "dtype", type(a))), getattr(a, "sharding", None))
            for a in leaves
        ]
        options = step_xla_options(self._mesh, arrays.tokens.shape[0] // arrays.groups)
        if self._model_text is None:  # (a 9B model's graph definition is long: once)
            self._model_text = canonical(self._graphdef)
        # A sharding's repr names its mesh's axes, not which device holds which index.
        devices = [d.id for d in self._execution_devices()]
        return self.executable_cache.key(
            "step", self._model_text, devices, tree, avals, kwargs, sorted(options.items())
        )

    def _execution_devices(self) -> list[jax.Device]:
        """The devices a step program runs on, in its device assignment's order: the
        mesh's, or the one holding the parameters."""
        if self._mesh is not None:
            return list(self._mesh.devices.flat)
        return sorted(self.param_leaves[0].sharding.device_set, key=lambda d: d.id)

    def _uses_executable_cache(self) -> bool:
        # Several processes would each load their part of a program: not supported here.
        return self.executable_cache is not None and jax.process_count() == 1

    def load_steps(
        self,
        steps: Sequence[tuple[StepArrays, np.ndarray | None, StateSnapshots | None]],
        pool: concurrent.futures.Executor | None = None,
    ) -> list[bool]:
        """For each ``(arrays, restore_ids, snapshots)``: whether the executable cache held
        its step program (now loaded: its launches run it, untraced). The keys are built
        on this thread (they read the device arrays), which must be the one that launches
        steps; the entries are read and loaded in ``pool`` (deserialising a program and
        loading its kernels onto the device mostly outside the GIL), one after another
        without. Call it before ``keep_step`` of such a step."""
        if not self._uses_executable_cache():
            return [False] * len(steps)
        devices = self._execution_devices()
        keys = [(self._signature(*step), self._cache_key(*step)) for step in steps]
        load = functools.partial(self.executable_cache.load, devices=devices)
        if pool is None:
            found = [load(key) for _, key in keys]
        else:
            found = list(pool.map(load, [key for _, key in keys]))
        for (signature, key), compiled in zip(keys, found, strict=True):
            if compiled is None:
                self._missing[signature] = key  # for keep_step, maybe on a compile thread
            else:
                self._executables[signature] = compiled
                self.loaded_count += 1
        return [compiled is not None for compiled in found]

    def keep_step(
        self,
        arrays: StepArrays,
        restore_ids: np.ndarray | None,
        snapshots: StateSnapshots | None,
        compiled: jax.stages.Compiled,
    ) -> None:
        """``compiled`` (``lower_step(arrays, ...).compile()``) runs the launches of such
        steps from now on, and is written to the executable cache. Without one, nothing:
        the jitted step finds its compiled program itself. Thread-safe after
        ``load_steps`` of the same step."""
        if not self._uses_executable_cache():
            return
        signature = self._signature(arrays, restore_ids, snapshots)
        key = self._missing.pop(signature, None)
        if key is None:
            key = self._cache_key(arrays, restore_ids, snapshots)
        self._executables[signature] = compiled
        self.executable_cache.store(key, compiled)

    # ------------------------------------------------------------------------ launching

    def launch(
        self,
        arrays: StepArrays,
        sampling: dict[str, np.ndarray],
        restore_ids: np.ndarray | None = None,
        snapshots: StateSnapshots | None = None,
        *,
        logprobs: bool = False,
    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...] | None]:
        """Launches one built step and its sampling: ``(logits[R, V], tokens[R],
        logprobs)``, on the device and not waited for (``R`` sequence rows, padding
        included); ``logprobs`` (when asked for) the rows' ``_logprobs``. ``sampling``: the
        rows' settings from ``sampling_arrays``. After a launch that raised, call
        ``recover``."""
        draws, restricts = sampler_flags(sampling, self.cfg.vocab_size)
        args, kwargs = self.step_arguments(arrays, restore_ids, snapshots)
        compiled = None
        if self._executables:
            compiled = self._executables.get(self._signature(arrays, restore_ids, snapshots))
        if compiled is not None:  # (its static num_decode is compiled in)
            logits, self.caches, tokens, self.slot_tokens = compiled(*args)
        else:
            logits, self.caches, tokens, self.slot_tokens = self.program(arrays)(*args, **kwargs)
        if draws:  # else the step's argmax is every row's token
            tokens = self.launch_sampler(logits, arrays.slot_ids, sampling, restricts=restricts)
        return logits, tokens, self.logprobs_program(logits, tokens) if logprobs else None

    def launch_sampler(
        self,
        logits: jax.Array,
        slot_ids: np.ndarray,
        sampling: dict[str, np.ndarray],
        *,
        restricts: bool,
    ) -> jax.Array:
        """Launches the drawing sampler on a step's logits; its tokens (on the device)."""
        args = self._sampler_arguments(logits, slot_ids, sampling)
        tokens, self.slot_tokens = self.sampler_program(*args, draws=True, restricts=restricts)
        return tokens

    def _sampler_arguments(
        self, logits: jax.Array, slot_ids: np.ndarray, sampling: dict[str, np.ndarray]
    ) -> tuple:
        """``sampler_program``'s positional arguments (its flags are keywords)."""
        settings = ("temperature", "top_k", "top_p", "seeds", "counters")
        return (logits, self.slot_tokens, slot_ids, *(sampling[k] for k in settings))

    def lower_samplers(
        self, logits: jax.Array, tokens: jax.Array, slot_ids: np.ndarray
    ) -> list[jax.stages.Lowered]:
        """The sampler's two programs for a step's ``logits[R, V]`` (drawing, without and
        with a cutoff) and the log-probabilities' (of its ``tokens[R]``), traced and
        lowered on those arrays, not compiled: as :meth:`lower_step`, each ``compile()``
        leaves the executable the programs' later calls on such a step run."""
        rows = slot_ids.shape[0]
        args = self._sampler_arguments(logits, slot_ids, sampling_arrays([None] * rows, [0] * rows))
        samplers = [
            self.sampler_program.lower(*args, draws=True, restricts=restricts)
            for restricts in (False, True)
        ]
        return [*samplers, self.logprobs_program.lower(logits, tokens)]

    def recover(self) -> bool:
        """After a launch that raised: the caches were donated to it, and if it consumed
        them (an interrupt or a device error after dispatch) fresh zero caches replace
        them; True then (every slot's state is lost: the caller drops its pages and
        prefix cache). Slots given back are unharmed, since a new sequence never reads its
        slot's old state."""
        lost = any(leaf.is_deleted() for leaf in jax.tree.leaves(self.caches))
        if lost:
            self.caches = self._init_cache()
        if self.slot_tokens.is_deleted():
            self.slot_tokens = self._zero_slot_tokens()
        return lost

    # ------------------------------------------------------------------------ device arrays

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
