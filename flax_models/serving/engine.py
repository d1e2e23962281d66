"""Serving: the ``Engine`` facade over the scheduler, the request loop and the step programs.

``Engine(model)`` lays out slot-indexed caches for ``max_slots`` sequences of ``max_len``
tokens and serves token-id prompts, offline (``generate``, ``stream``) or request by
request (``add_request``, ``step``, ``abort_request``). Every argument and prompt is
checked first (``serving.inputs``). A request's data flows::

    prompt ids ─ inputs ─> RequestState / SequenceState (serving.request), waiting
      Scheduler.schedule: admission (slot, prefix hit, page reservation)
                          ─> StepPlan (bucketed StepArrays, rows, sampling, restores/saves)
      StepRunner.launch(plan) ─> LaunchedStep (tokens, logprobs on the device)
      Scheduler.land: stats, published blocks, TokenEvents
      OutputProcessor: text, stop strings, logprobs ─> RequestOutput ─> the caller

``serving.loop`` turns this one step ahead (step n + 1 launched before step n's tokens are
read). Attention K/V live in a pool of pages that per-slot block tables index
(``serving.prefix_cache``); with ``prefix_caching=True`` a prompt starts after the longest
run of full blocks computed before. On a mesh with a ``"dp"`` axis the slots and pools are
split into dp groups (``flax_models.sharding``); a step is one program per bucket.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels as pk
from flax_models.batch import StateSnapshots
from flax_models.model import HybridLM
from flax_models.serving.batching import BatchBuilder, StepArrays
from flax_models.serving.executables import ExecutableCache
from flax_models.serving.inputs import check_buckets, check_eos_ids, check_prompts, check_sampling
from flax_models.serving.loop import RequestLoop
from flax_models.serving.output_processor import OutputProcessor
from flax_models.serving.outputs import EventStream, StepStats, TokenEvent, progress_bar
from flax_models.serving.prefix_cache import BlockManager, GroupedBlockManager
from flax_models.serving.request import RequestState
from flax_models.serving.runner import StepRunner
from flax_models.serving.sampling import SEED_LIMIT, SamplingParams, sampling_arrays
from flax_models.serving.scheduler import Scheduler
from flax_models.sharding import dp_size

__all__ = ["DEFAULT_TOKEN_BUCKET_POLICY", "Engine", "TokenEvent"]

logger = logging.getLogger(__name__)

# The default token buckets' spacing (``pk.token_buckets``). Powers of √2 hold n prompt
# tokens in at most max(16, ceil16(√2 n)) (~41% padding once n is in the hundreds; powers of
# two: 100%) for about twice the buckets, still logarithmic in the budget. Measured on
# Bamba-9B's shape (docs/notes, token bucket policies): the serving trace's prompt-token
# padding 15.3% → 9.1% for 16 programs used instead of 11, and the ragged 22.5k-token
# prefill runs in 23,184 tokens rather than multiples of 4096's 24,576.
DEFAULT_TOKEN_BUCKET_POLICY: pk.metadata.TokenBucketPolicy = "sqrt2"
# Prefill sequence rows of a step (Engine's max_prefill_seqs): each costs its per-sequence
# work even as padding, and a step's token budget seldom holds more prompts than this.
DEFAULT_MAX_PREFILL_SEQS = 16
# The SSM state cache's dtypes (vLLM's ``mamba_ssm_cache_dtype``); "auto" is the model's.
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def resolve_ssm_cache_dtype(value: str, model_dtype: jnp.dtype) -> jnp.dtype:
    """The SSM state cache's dtype for ``mamba_ssm_cache_dtype=value`` ("auto": the model's
    dtype, which must then be float32 or bfloat16)."""
    if value not in MAMBA_SSM_CACHE_DTYPES:
        raise ValueError(
            f"mamba_ssm_cache_dtype={value!r}: expected one of {MAMBA_SSM_CACHE_DTYPES}"
        )
    dtype = jnp.dtype(model_dtype if value == "auto" else value)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(
            f"mamba_ssm_cache_dtype='auto' is the model's dtype {dtype.name}: the state "
            "kernels take float32 or bfloat16 states; give one of them"
        )
    return dtype


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
      max_prefill_seqs: prompts one step computes chunks of, at most (of each slot group;
        >= 1); ``min(16, max_slots / dp)`` by default. Every step with prompt tokens
        carries this many prefill sequence rows, padding ones included, and their
        per-sequence work (states read and written, state-scan programs) is paid whether
        or not a row is real: on an H200 a Bamba-9B step of one 1024-token prompt took
        105 ms with 256 such rows, 35.8 ms with 16 and 32.3 ms with 1 (2026-12-03).
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
      executable_cache_dir: a directory where ``warmup`` keeps the compiled step programs
        (``serving.executables``): a later engine of the same model, options and library
        code on the same devices loads them instead of tracing, lowering and compiling
        them. None (the default): no such cache.
      mamba_ssm_cache_dtype: the SSM state cache's dtype (and its prefix snapshots'):
        "float32" (the default), "bfloat16" or "auto" (the model's dtype, vLLM's default).
        The kernels accumulate in fp32 either way; bfloat16 rounds the states after every
        step and halves what they take in memory and what a decode row reads and writes:
        on Bamba-9B 121 MB of fp32 states a slot, most of a 256-row decode step's bytes.

    Attributes:
      scheduler: the ``Scheduler`` (admission, slots, step plans); ``runner``: the
        ``StepRunner`` (the step programs and the caches); ``builder``: the
        ``BatchBuilder`` of the step buckets.
      blocks: the ``BlockManager`` of the KV pages and the prefix cache; with dp slot
        groups a ``GroupedBlockManager`` (one ``BlockManager`` per group).
      compile_count: programs compiled for this engine's steps (``StepRunner``).
      stats: the steps' wall time and real tokens and the prefix-cache counts
        (``serving.outputs.StepStats``).
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
        max_prefill_seqs: int | None = None,
        kv_block_size: int | None = None,
        num_kv_blocks: int | None = None,
        prefix_caching: bool = False,
        num_prefix_snapshots: int | None = None,
        tokenizer=None,
        eos_token_ids: Iterable[int] = (),
        seed: int = 0,
        executable_cache_dir: str | os.PathLike | None = None,
        mamba_ssm_cache_dtype: str = "float32",
    ):
        max_slots = pk.check_int("max_slots", max_slots, low=1)
        ssm_cache_dtype = resolve_ssm_cache_dtype(mamba_ssm_cache_dtype, model.dtype)
        groups = dp_size(model.mesh)  # the slot groups, one per "dp" index of the mesh
        max_len = pk.check_int("max_len", max_len, low=1)
        token_budget = pk.check_int("token_budget", token_budget, low=1)
        cfg = model.cfg
        has_mamba = bool(set("MP") & set(cfg.layer_pattern))
        if kv_block_size is None:
            # The Mamba chunk size (DESIGN §8): a cached prefix of one chunk or more hits;
            # configs without Mamba layers keep the field too (256 unless set).
            kv_block_size = cfg.mamba_chunk_size
        block_size = pk.check_int("kv_block_size", kv_block_size, low=1)
        if prefix_caching and has_mamba and block_size % cfg.mamba_chunk_size:
            raise ValueError(
                f"kv_block_size={block_size} must be a multiple of the Mamba chunk size "
                f"{cfg.mamba_chunk_size} for prefix caching (states are saved at chunk ends)"
            )
        max_blocks = -(-max_len // block_size)
        num_kv_blocks = pk.check_int(
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
            num_snapshots = pk.check_int(
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
        max_prefill_seqs = pk.check_int(
            "max_prefill_seqs",
            min(DEFAULT_MAX_PREFILL_SEQS, slots_per_group)
            if max_prefill_seqs is None
            else max_prefill_seqs,
            low=1,
        )
        grouped = GroupedBlockManager(
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
        self.cfg = cfg
        self.token_budget = token_budget
        self.builder = BatchBuilder(
            num_slots=max_slots,
            max_len=max_len,
            decode_buckets=check_buckets(
                "decode_buckets",
                decode_buckets,
                pk.sequence_buckets(slots_per_group),
                covers=slots_per_group,
                what="max_slots" if groups == 1 else "max_slots / dp",
            ),
            token_buckets=check_buckets(
                "token_buckets",
                token_buckets,
                pk.token_buckets(token_budget, min_tokens=16, policy=DEFAULT_TOKEN_BUCKET_POLICY),
                covers=token_budget,
                what="token_budget",
            ),
            prefill_seqs=max_prefill_seqs,
            vocab_size=self.cfg.vocab_size,
            groups=groups,
        )
        self._stats = StepStats()
        self.scheduler = Scheduler(
            self.builder,
            grouped,
            token_budget=token_budget,
            prefix_caching=self.prefix_caching,
            stats=self._stats,
        )
        self.blocks = self.scheduler.blocks
        executables = None
        if executable_cache_dir is not None:
            executables = ExecutableCache(executable_cache_dir)
        self.runner = StepRunner(
            model, self.builder, self.blocks, executables, ssm_cache_dtype=ssm_cache_dtype
        )
        self.eos_token_ids = check_eos_ids(eos_token_ids)
        self.loop = RequestLoop(
            self.scheduler,
            self._launch,
            OutputProcessor(tokenizer),
            seed=pk.check_int("seed", seed, low=0),
        )

    # ------------------------------------------------------------------------ state

    @property
    def caches(self):
        """The slot-indexed caches (conv/SSM states, KV page pools, snapshot pools)."""
        return self.runner.caches

    @property
    def compile_count(self) -> int:
        return self.runner.compile_count

    @property
    def stats(self) -> dict[str, float]:
        return self._stats.values

    @property
    def step_buckets(self) -> collections.Counter[tuple[int, int]]:
        """How many steps ran in each ``(decode rows, prompt tokens)`` bucket."""
        return self._stats.step_buckets

    def update_weights(self, model: HybridLM) -> None:
        """Serves ``model``'s parameters from the next step on, e.g. after training steps
        on the engine's model: they must have the structure, shapes, dtypes and shardings
        of the parameters the engine was built with, so nothing recompiles. ValueError
        (nothing changed) otherwise."""
        _, params = nnx.split(model)
        leaves, tree = jax.tree.flatten(params)
        old = self.runner.param_leaves
        if tree != self.runner._param_tree or len(leaves) != len(old):
            raise ValueError("model: its parameters' structure differs from the engine's model")
        for i, (new, was) in enumerate(zip(leaves, old, strict=True)):
            if (new.shape, new.dtype) != (was.shape, was.dtype):
                raise ValueError(
                    f"model: parameter {i} is {new.dtype}{list(new.shape)}, the engine's "
                    f"{was.dtype}{list(was.shape)}"
                )
            if getattr(new, "sharding", None) != getattr(was, "sharding", None):
                raise ValueError(f"model: parameter {i} is placed unlike the engine's model")
        self.runner.load_params(model)

    # ------------------------------------------------------------------------ one step

    def _launch(
        self,
        arrays: StepArrays,
        sampling: dict[str, np.ndarray] | None = None,
        restore_ids: np.ndarray | None = None,
        snapshots: StateSnapshots | None = None,
        *,
        logprobs: bool = False,
    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...] | None]:
        """Launches a built step (pages first); ``(logits, tokens, logprobs)`` on the
        device. A launch that raised leaves the engine usable: lost caches are replaced,
        with every page and the prefix cache dropped with them."""
        if sampling is None:
            rows = arrays.slot_ids.shape[0]
            sampling = sampling_arrays([None] * rows, [0] * rows)
        if restore_ids is None and snapshots is None:
            restore_ids, snapshots = self.scheduler.direct_step_extras(arrays)
        self.scheduler.ensure_pages(arrays)
        try:
            return self.runner.launch(arrays, sampling, restore_ids, snapshots, logprobs=logprobs)
        except BaseException:
            if self.runner.recover():
                self.blocks.reset()
            raise

    def step(self, arrays: StepArrays | None = None, *, wait: bool = True):
        """Without ``arrays``: one step of the requests added with ``add_request``; the
        ``RequestOutput`` of every request that advanced (cumulative so far), in order.

        With ``arrays`` (a step built by hand with ``builder``): runs that step alone;
        returns the last-token logits of every sequence row,
        ``[R, V]`` fp32, on the device (a 256-row step's logits are 128 MiB at V = 128k:
        copying them to the host would take longer than the step; sample on the device).

        ``wait=False`` returns once the step is launched, without counting it in ``stats``:
        for callers that chain steps (a decode row's token may be ``FROM_DEVICE``, the one
        its slot sampled in the step before)."""
        if arrays is None:
            return self.loop.step_requests()
        start = time.perf_counter()
        logits, tokens, _ = self._launch(arrays)
        if wait:
            jax.block_until_ready((logits, tokens))
            if arrays.num_requests:
                self._stats.count_step(arrays, time.perf_counter() - start)
        return logits

    def warmup(
        self,
        *,
        buckets: Iterable[tuple[int, int]] | None = None,
        progress: bool | None = None,
        compile_workers: int | None = None,
    ) -> int:
        """Compiles every program a generation can use: a step per bucket (greedy tokens
        included), the sampler's two and the log-probabilities' per count of rows
        (all-padding steps change no cache); returns ``compile_count``.

        ``buckets``: the ``(decode bucket, token bucket)`` pairs to compile, a subset of
        ``builder.buckets()`` (all of them when None), e.g. those a known workload uses.
        The step programs are traced one after another and compiled in
        ``compile_workers`` threads at once (XLA compiles outside the GIL; None: up to 8,
        and no more than the CPU cores), then each runs once, and the samplers of each of
        their row counts are lowered on its logits and compiled in the same threads. With
        an ``executable_cache_dir``, a step program found there is loaded instead, in the
        same threads (not traced, lowered or compiled, nor counted in ``compile_count``:
        see ``runner.loaded_count``), and one compiled is written there. Logs a line per step
        program (``logging``, this module's logger); ``progress``: a bar on stderr (None: on
        a terminal)."""
        grid = self.builder.buckets()
        if buckets is None:
            buckets = grid
        else:
            buckets = [tuple(b) for b in buckets]
            outside = [b for b in buckets if b not in grid]
            if outside:
                raise ValueError(
                    f"buckets {outside} are not (decode bucket, token bucket) pairs of this "
                    f"engine (decode buckets {self.builder.decode_buckets}, token buckets "
                    f"{self.builder.token_buckets}; 0 for none)"
                )
        if compile_workers is None:
            compile_workers = max(1, min(8, os.cpu_count() or 1))
        compile_workers = pk.check_int("compile_workers", compile_workers, low=1)
        start, before = time.perf_counter(), self.compile_count
        bar = progress_bar(len(buckets), enabled=progress, desc="compiling", unit="program")

        def compile_step(bucket: tuple[int, int], arrays: StepArrays, extras, lowered) -> None:
            began = time.perf_counter()
            self.runner.keep_step(arrays, *extras, lowered.compile())
            logger.info(
                "warmup: compiled the step of %d decode rows + %d prompt tokens in %.2f s",
                *bucket,
                time.perf_counter() - began,
            )
            bar.update(1)

        steps = [self.builder.dummy(*bucket) for bucket in buckets]
        with concurrent.futures.ThreadPoolExecutor(compile_workers) as pool:
            compiles, lowering_s = [], 0.0
            extras = [self.scheduler.direct_step_extras(arrays) for arrays in steps]
            found = self.runner.load_steps(
                [(arrays, *e) for arrays, e in zip(steps, extras, strict=True)], pool
            )
            loaded = sum(found)
            bar.update(loaded)
            for bucket, arrays, extra, hit in zip(buckets, steps, extras, found, strict=True):
                if hit:
                    continue
                began = time.perf_counter()
                lowered = self.runner.lower_step(arrays, *extra)
                lowering_s += time.perf_counter() - began
                compiles.append(pool.submit(compile_step, bucket, arrays, extra, lowered))
            if loaded:
                logger.info(
                    "warmup: loaded %d step program(s) from %s in %.1f s",
                    loaded,
                    self.runner.executable_cache.directory,
                    time.perf_counter() - start,
                )
            logger.info(
                "warmup: traced and lowered %d step program(s) in %.1f s (the main thread)",
                len(compiles),
                lowering_s,
            )
            for done in compiles:
                done.result()  # (a compile's error, raised here)
            bar.close()
            logger.info("warmup: step programs compiled at %.1f s", time.perf_counter() - start)
            # Each step runs once (the executables compiled above); the samplers of each
            # row count are lowered on its logits and compiled in the same threads.
            warmed, compiles = set(), []
            for arrays in steps:
                logits, tokens, _ = self._launch(arrays)
                rows = arrays.slot_ids.shape[0]
                if rows not in warmed:
                    warmed.add(rows)
                    for lowered in self.runner.lower_samplers(logits, tokens, arrays.slot_ids):
                        compiles.append(pool.submit(lowered.compile))
                jax.block_until_ready(tokens)
            for done in compiles:
                done.result()
        logger.info(
            "warmup: %d program(s) for %d step bucket(s) in %.1f s (%d compile threads)",
            self.compile_count - before,
            len(buckets),
            time.perf_counter() - start,
            compile_workers,
        )
        return self.compile_count

    # ------------------------------------------------------------------------ slots

    def allocate_slot(self) -> int:
        """A free cache slot, for steps built by hand (``step``)."""
        return self.scheduler.allocate_slot()

    def release_slot(self, slot: int) -> None:
        """Frees a slot taken with ``allocate_slot`` and its KV pages."""
        self.scheduler.release_slot(slot)

    @property
    def num_free_slots(self) -> int:
        return len(self.scheduler.free_slots)

    def clear_prefix_cache(self) -> None:
        """Forgets every cached prefix (between generations): later prompts compute from
        their first token until blocks are published again."""
        self.blocks.clear_cache()

    def use_prefix_cache(self, enabled: bool) -> None:
        """Switches lookups and publishing on or off (between generations) in an engine
        built with ``prefix_caching=True``, on the same compiled programs (A/B runs). Off,
        nothing is looked up, published or saved, but the steps stay a caching engine's
        (the Mamba prefill still runs the snapshot path): not an engine built without
        ``prefix_caching``."""
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
    ) -> EventStream:
        """Generates like ``generate``, yielding each token as it is drawn: ``TokenEvent(index,
        token, finish_reason)``, in the order the steps produce them (a request's own
        tokens in order). ``sampling``: one ``SamplingParams`` for every prompt, one per
        prompt, or None for the defaults. ``eos_ids`` end a request (the engine's own
        ``eos_token_ids`` are not used here).

        ``stop(index, token)``, when given, is called on the host after each generated token
        that is not a stop token; True ends that request there (``finish_reason="stop"``).
        Everything is checked here, before the first step; stopping the iteration early
        (``close()``, a ``break``) gives the slots back.
        """
        prompts = check_prompts(prompts, self.cfg.vocab_size)
        params = check_sampling(sampling, len(prompts))
        eos = check_eos_ids(eos_ids)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            self.scheduler.check_fits(f"prompt {i}", prompt, p)
        sequences = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            seed = self.loop.draw_seed() if p.seed is None else p.seed
            seq = self.loop.new_sequence(prompt, p, eos | frozenset(p.stop_token_ids), seed)
            if stop is not None:
                seq.stop_check = lambda token, i=i: stop(i, token)
            sequences.append(seq)
        return EventStream(self.loop.serve(sequences, progress), sequences)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
    ) -> None:
        """Queues a request of ``sampling_params.n`` completions of ``prompt_token_ids``; it
        joins the running batch at the next ``step`` it fits in. ``ValueError`` (nothing
        queued) for an id in use, a bad prompt or settings, or a request that can never
        fit (prompt + ``max_tokens`` past ``max_len`` or the KV pool)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r} must be a non-empty string")
        if request_id in self.loop.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        (ids,) = check_prompts([prompt_token_ids], self.cfg.vocab_size)
        (params,) = check_sampling(sampling_params, 1)
        self.scheduler.check_fits(f"request {request_id!r}", ids, params)
        request = RequestState(request_id, prompt, ids, params)
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        first = self.loop.draw_seed() if params.seed is None else params.seed
        for i in range(params.n):
            # The i-th completion's seed follows from the first's.
            seed = first if i == 0 else int(np.random.default_rng([first, i]).integers(SEED_LIMIT))
            seq = self.loop.new_sequence(ids, params, stop_ids, seed)
            seq.request, seq.output_index = request, i
            request.sequences.append(seq)
        self.loop.add(request)

    def abort_request(self, request_id: str) -> None:
        """Ends request ``request_id`` where it stands (its slots and pages come back); an
        unknown or finished id is ignored."""
        self.loop.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.loop.requests)
