"""The engine's scheduler: admission into cache slots, prefix-cache planning, the plan of
each step, and landing a step's tokens.

Each step packs decode rows (one token per running sequence whose prompt is done) and
prompt chunks within the per-step token budget (chunked prefill: a long prompt spreads
over several steps, continuing from the cached state). Requests are admitted as slots and
KV pages free up (continuous batching), first come, first served.

With prefix caching (``prefix_cache.BlockManager``) an admitted prompt starts after the
longest run of full blocks computed before with the same tokens; its Mamba states come
from a snapshot saved when those blocks were computed, restored inside the step that runs
its first new tokens. Which block ends a step saves, and into which snapshot entries, is
part of the step's plan (``StepPlan.snapshots``), as data: no program more.

On a mesh with a ``"dp"`` axis the slots, pages and snapshots are split into dp equal
groups, each with its own prefix cache: a request goes to the group with the longest
prefix hit, then the most free slots, then the most free pages, and each group prefills
up to ``token_budget`` tokens a step.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import numpy as np

import pallas_kernels as pk
from flax_models.batch import StateSnapshots
from flax_models.serving.batching import FROM_DEVICE, BatchBuilder, Request, StepArrays
from flax_models.serving.outputs import StepStats, TokenEvent
from flax_models.serving.plan import LaunchedStep, ScheduledSequence, StepPlan
from flax_models.serving.prefix_cache import BlockManager, GroupedBlockManager
from flax_models.serving.request import SequenceState
from flax_models.serving.sampling import SamplingParams, sampling_arrays

__all__ = ["Scheduler"]

# Decode snapshot saves per step (``Scheduler.snapshot_capacity``).
_DECODE_SAVES = 4


class Scheduler:
    """Plans the engine's steps over ``builder``'s slots and the pages of ``grouped``.

    Attributes:
      blocks: the ``BlockManager`` of the KV pages and the prefix cache (a
        ``GroupedBlockManager`` with dp slot groups).
      free_slots: the slots no sequence holds, the next one ``allocate_slot`` gives last.
    """

    def __init__(
        self,
        builder: BatchBuilder,
        grouped: GroupedBlockManager,
        *,
        token_budget: int,
        prefix_caching: bool,
        stats: StepStats,
    ):
        self.builder = builder
        # The grouped view also translates snapshot ids between global (the host's) and
        # group-local (the step's), also for a single group.
        self._grouped = grouped
        self._block_groups = grouped.groups
        self.blocks: BlockManager | GroupedBlockManager = (
            grouped.groups[0] if builder.groups == 1 else grouped
        )
        self.block_size = grouped.block_size
        self.token_budget = token_budget
        self.prefix_caching = prefix_caching
        self.stats = stats
        self.free_slots = list(range(builder.num_slots - 1, -1, -1))
        self._clock = 0.0  # when the host last saw a step of ``stream`` finish

    # ------------------------------------------------------------------------ slots

    def allocate_slot(self) -> int:
        if not self.free_slots:
            raise RuntimeError("no free cache slot")
        return self.free_slots.pop()

    def release_slot(self, slot: int) -> None:
        """Frees a slot and its KV pages. Its stale state is never read: the next sequence
        there starts with num_computed = 0 (no initial conv/SSM state) or from a restored
        snapshot, and kv_lens bound its attention."""
        if slot in self.free_slots or not 0 <= slot < self.builder.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self.blocks.release(slot)
        self.free_slots.append(slot)

    def check_fits(self, name: str, prompt: list[int], params: SamplingParams) -> None:
        """ValueError (naming the request: ``name``) when it can never run: more tokens
        than a slot holds, or more KV pages than its slot group's pool."""
        if len(prompt) + params.max_new_tokens > self.builder.max_len:
            raise ValueError(
                f"{name}: {len(prompt)} tokens + {params.max_new_tokens} new "
                f"exceed max_len={self.builder.max_len}"
            )
        pages = -(-(len(prompt) + params.max_new_tokens - 1) // self.block_size)
        pool = self._block_groups[0].num_pages  # a sequence's pages are its group's
        if pages > pool:
            where = "" if self.builder.groups == 1 else f" / dp={self.builder.groups}"
            raise ValueError(
                f"{name}: {len(prompt)} tokens + {params.max_new_tokens} new need "
                f"{pages} KV pages of {self.block_size} tokens; num_kv_blocks="
                f"{self.blocks.num_pages}{where}"
            )

    def stall_reason(self, seq: SequenceState) -> str:
        """Why ``seq`` can never be admitted with nothing running: slots or pages held by
        ``allocate_slot`` and direct ``step`` calls outside the generation."""
        held = self.builder.num_slots - len(self.free_slots)
        if not self.free_slots:
            return (
                f"request {seq.index} waits for a cache slot, but all {held} are held outside "
                "generate (allocate_slot); release_slot() them first"
            )
        return (
            f"request {seq.index} needs KV pages for {len(seq.prompt)} + "
            f"{seq.params.max_new_tokens} tokens, but {held} slots held outside generate "
            f"(allocate_slot and step) keep the pool's other pages; release_slot() them first"
        )

    # ------------------------------------------------------------------------ admission

    def _group(self, slot: int) -> int:
        """The slot group of ``slot`` (0 without dp groups)."""
        return slot // self.builder.slots_per_group

    def next_admissible(
        self, waiting: collections.deque[SequenceState], running: list[SequenceState]
    ) -> SequenceState | None:
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
            for key in r.hashes[r.num_computed // bs : len(r.prompt) // bs]
        }
        for seq in waiting:
            usable = (len(seq.prompt) - 1) // bs  # seq.hashes may hold more (a failed admit)
            hit = max(blocks.lookup(seq.prompt, seq.hashes)[0] for blocks in self._block_groups)
            if hit == usable or seq.hashes[hit] not in in_flight:
                return seq
        return None

    def _slot_choices(self, seq: SequenceState) -> list[int]:
        """A free slot of each slot group that has one, in the order admission tries them
        for ``seq``: the group with the longest prefix hit first (prefix caching), then the
        most free slots, then the most free pages."""
        first: dict[int, int] = {}  # group -> its free slot allocate_slot would give first
        free = [0] * self.builder.groups
        for slot in reversed(self.free_slots):
            group = self._group(slot)
            first.setdefault(group, slot)
            free[group] += 1
        if len(first) == 1:
            return list(first.values())

        def preference(group: int) -> tuple[int, ...]:
            blocks = self._block_groups[group]
            hit = blocks.lookup(seq.prompt, seq.hashes)[0] if self.prefix_caching else 0
            return -hit, -free[group], -blocks.num_free_pages, group

        return [first[g] for g in sorted(first, key=preference)]

    def _admit(self, seq: SequenceState) -> bool:
        """Gives ``seq`` a slot, its cached prefix (prefix caching) and its page
        reservation; False (nothing changed) when no slot group's pool can hold them yet."""
        for slot in self._slot_choices(seq):
            hit = self.blocks.admit(
                slot, seq.prompt, seq.hashes, len(seq.prompt) + seq.params.max_new_tokens - 1
            )
            if hit is not None:
                break
        else:
            return False
        self.free_slots.remove(slot)
        seq.slot = slot
        seq.num_computed, seq.restore = hit.tokens, hit.snapshot
        if self.prefix_caching:
            self.stats.count_admission(hit.tokens)
        return True

    def admit_waiting(
        self, waiting: collections.deque[SequenceState], running: list[SequenceState]
    ) -> None:
        """Moves what fits from ``waiting`` to ``running`` (first come, first served; a
        request that waits for pages holds back those after it); each admitted request
        notes its prefix hit tokens (``prefix_hit``)."""
        while waiting and self.free_slots:
            seq = self.next_admissible(waiting, running)
            if seq is None or not self._admit(seq):
                break
            waiting.remove(seq)
            running.append(seq)
            seq.prefix_hit = seq.num_computed

    # ------------------------------------------------------------------------ planning

    def schedule(
        self,
        waiting: collections.deque[SequenceState],
        running: list[SequenceState],
        *,
        ahead: bool,
    ) -> StepPlan | None:
        """Admits what fits, then plans the next step: decode rows for the sequences whose
        prompt is done, prompt chunks within the token budget. ``ahead``: a step is in
        flight whose tokens the host has not read; None (nothing to launch) when the plan
        would depend on them, or when nothing is left to run.

        Where the plan would depend on the tokens in flight (a prefix-caching state save at
        a block end of a row fed from the device, or an admission with prefix caching,
        which must see the blocks that step publishes), it waits for them."""
        bs = self.block_size
        if not (ahead and self.prefix_caching):
            self.admit_waiting(waiting, running)
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
        prefill: list[tuple[SequenceState, int]] = []
        prompts = [self.builder.prefill_seqs] * self.builder.groups  # rows left per group
        for seq in live:
            group = self._group(seq.slot)
            if not seq.prompt_done and budgets[group] and prompts[group]:
                count = min(len(seq.prompt) - seq.num_computed, budgets[group])
                prefill.append((seq, count))
                budgets[group] -= count
                prompts[group] -= 1
        if decode and waiting:  # saturated, and a next step runs for the decode rows anyway
            prefill = self.fit_token_bucket(prefill)
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
            snapshots, taken = self.snapshot_plan(arrays, fed)
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
        scheduled = []
        for (seq, count), row in zip(fed, rows, strict=True):
            samples = seq.num_computed + count >= len(seq.prompt)
            if samples:
                row_params[row] = seq.params
                counters[row] = seq.num_generated
            restored = seq.restore is not None
            scheduled.append(ScheduledSequence(seq, seq.num_computed, count, samples, restored))
        return StepPlan(
            arrays=arrays,
            scheduled=scheduled,
            rows=rows,
            sampling=sampling_arrays(row_params, counters),
            restore_ids=restore_ids,
            snapshots=snapshots,
            taken=taken,
        )

    def fit_token_bucket(
        self, prefill: list[tuple[SequenceState, int]]
    ) -> list[tuple[SequenceState, int]]:
        """``prefill`` (sequences and token counts, in order) cut down to the largest token
        bucket its tokens fill when that bucket and the one the cut tokens would take alone
        hold fewer tokens than the bucket they would all be padded up to: padding tokens
        cost what real ones do, and the cut tokens (the last sequences' tails) run in the
        next step, which the decode rows hold anyway (beside its own prompt tokens, if
        any). Each slot group is cut to the bucket of the group with the most tokens.

        ``schedule`` cuts only under load (requests wait for a slot): the cut delays a
        prompt's first token by a step, which an idle server's TTFT would pay for (an H200
        serving Bamba-9B at 1 request/s, 2026-12-03: a 1058-token prompt cut to 1024 + 34
        beside one decode row took two steps, 95 ms, where its 2048-token bucket took
        about 65)."""
        totals = [0] * self.builder.groups
        for seq, count in prefill:
            totals[self._group(seq.slot)] += count
        most = max(totals)
        if not most:
            return prefill
        buckets = self.builder.token_buckets
        lower = max((b for b in buckets if b <= most), default=0)
        if not lower or lower + pk.bucket_for(most - lower, buckets) >= pk.bucket_for(
            most, buckets
        ):
            return prefill
        excess = [max(total - lower, 0) for total in totals]
        fitted = []
        for seq, count in reversed(prefill):
            group = self._group(seq.slot)
            cut = min(count, excess[group])
            excess[group] -= cut
            if count > cut:
                fitted.append((seq, count - cut))
        return fitted[::-1]

    def commit(self, plan: StepPlan) -> None:
        """Moves the host's view on once ``plan`` is launched: what the step computes does
        not depend on its tokens; what it samples is counted in flight until it is read."""
        for entry in plan.scheduled:
            seq = entry.seq
            seq.num_computed += entry.count
            seq.restore = None
            seq.in_flight += entry.samples

    def abandon(self, plan: StepPlan) -> None:
        """Gives back the snapshot entries of a plan that will never be read."""
        self.blocks.give_back_snapshots(plan.taken_entries())

    def direct_step_extras(
        self, arrays: StepArrays
    ) -> tuple[np.ndarray | None, StateSnapshots | None]:
        """``(restore_ids, snapshots)`` for a step built outside the scheduler: with prefix
        caching it restores and saves nothing; without, the step takes neither."""
        if not self.prefix_caching:
            return None, None
        rows = arrays.slot_ids.shape[0] - arrays.groups * arrays.num_decode
        return np.full(rows, -1, np.int32), self.snapshot_plan(arrays, [])[0]

    def ensure_pages(self, arrays: StepArrays) -> None:
        """Gives every live row's slot the pages its keys need in this step."""
        kv_lens = arrays.num_computed_tokens + arrays.query_lens
        for slot, kv_len in zip(arrays.slot_ids.tolist(), kv_lens.tolist(), strict=True):
            if slot >= 0:
                self.blocks.ensure(slot, kv_len)

    def snapshot_capacity(self, num_decode: int, token_bucket: int) -> tuple[int, int]:
        """Static numbers of decode and prefill snapshot saves of a step's bucket. Prefill:
        a sequence of n new tokens crosses at most ``n // block_size + 1`` block ends, each
        needing a token, so every save fits. Decode: each save gathers a row's states (4
        MB per Mamba layer on Bamba-9B), so a step takes a few (rows end blocks one token
        in a block size apart); rows past them publish their block without a snapshot."""
        prefill = 0
        if token_bucket:
            prefill = min(token_bucket, token_bucket // self.block_size + self.builder.prefill_seqs)
        return min(num_decode, _DECODE_SAVES), prefill

    def snapshot_plan(
        self, arrays: StepArrays, fed: list[tuple[SequenceState, int]]
    ) -> tuple[StateSnapshots, dict[int, dict[int, int]]]:
        """Which block ends of this step save their Mamba states, into which snapshot
        entries: ``(StateSnapshots, {sequence index: {block: entry}})``. ``fed``: the
        step's sequences and their token counts, in row order (decode rows first). A block
        end is saved when prefix caching wants it (``BlockManager.wants_snapshot``) and an
        entry is free or evictable. With G slot groups each group saves into its own pool,
        up to the bucket's capacity each: the columns are the groups' one after another,
        with rows and entries local to the group (``taken`` holds global entries)."""
        bs, num_decode, groups = self.block_size, arrays.num_decode, arrays.groups
        group_rows = arrays.slot_ids.shape[0] // groups
        decode_capacity, capacity = self.snapshot_capacity(*arrays.bucket)
        # Per group: (decode row, entry) and (prefill sequence, position, entry).
        decode_saves: list[list[tuple[int, int]]] = [[] for _ in range(groups)]
        saves: list[list[tuple[int, int, int]]] = [[] for _ in range(groups)]
        taken: dict[int, dict[int, int]] = {}
        for (seq, count), row in zip(fed, arrays.rows if fed else [], strict=True):
            start = seq.num_computed
            ends = range((start // bs + 1) * bs, start + count + 1, bs)
            if not ends or not self.blocks.num_snapshots:
                continue
            group, local_row = divmod(int(row), group_rows)
            blocks = self._block_groups[group]
            tokens = seq.tokens()
            for end in ends:
                block = end // bs - 1
                full = (
                    len(saves[group]) == capacity
                    if local_row >= num_decode
                    else (len(decode_saves[group]) == decode_capacity)
                )
                if full:
                    break
                if not blocks.wants_snapshot(tokens, seq.hashes, block):
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

    # ------------------------------------------------------------------------ landing

    def land(
        self,
        step: LaunchedStep,
        tokens: np.ndarray,
        now: float,
        running: list[SequenceState],
    ) -> Iterator[TokenEvent]:
        """Lands a launched step whose ``tokens`` the host read at ``now``: its stats, its
        bookkeeping, then its events; rows of sequences that ended before it are
        discarded. A request ends at a stop id, when its ``stop_check`` says so, or at
        ``max_tokens``."""
        plan = step.plan
        kept = [f for f in plan.scheduled if not f.seq.ended]
        num_decode = plan.arrays.num_decode_requests  # the first entries are decode rows
        self.stats.count_step(
            plan.arrays,
            # The device ran the step after the one before it ended (or after its launch).
            now - max(step.launched_at, self._clock),
            decode_tokens=sum(not f.seq.ended for f in plan.scheduled[:num_decode]),
            prefill_tokens=sum(f.count for f in plan.scheduled[num_decode:]),
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
                self._publish(f.seq, f.start, f.start + f.count, plan.taken.pop(f.seq.index, {}))
        self.abandon(plan)
        plan.taken.clear()
        return self._events(plan, tokens, running)

    def _events(
        self,
        plan: StepPlan,
        tokens: np.ndarray,
        running: list[SequenceState],
    ) -> Iterator[TokenEvent]:
        for f, row in zip(plan.scheduled, plan.rows, strict=True):
            seq = f.seq
            if seq.ended or not f.samples:
                continue
            token = int(tokens[row])
            seq.in_flight -= 1
            seq.generated.append(token)
            if token in seq.stop_ids or (seq.stop_check is not None and seq.stop_check(token)):
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

    def _publish(
        self, seq: SequenceState, start: int, stop: int, snapshots: dict[int, int]
    ) -> None:
        """Publishes the blocks ``seq`` filled in a step that took it from ``start`` to
        ``stop`` computed tokens, with the snapshots saved at their ends."""
        first, end = start // self.block_size, stop // self.block_size
        if end > first:
            self.blocks.publish(seq.slot, seq.tokens(), seq.hashes, range(first, end), snapshots)
        elif snapshots:
            self.blocks.give_back_snapshots(list(snapshots.values()))
