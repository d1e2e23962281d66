"""Paged KV blocks and the chunk-granular prefix cache of the engine (host side).

The attention K/V of every attention layer is one pool of pages
``[num_pages, block_size, Hkv, D]``; sequence ``s`` (in cache slot ``s``) keeps its key
``j`` in page ``tables[s, j // block_size]``. Pages are taken as a sequence grows and
given back when it ends, so memory follows the tokens held, not ``max_len``.

With prefix caching, every full block a sequence computes is *published* under a hash
chain of its tokens, ``key_i = hash((key_{i-1}, tokens of block i))``, so a key names the
whole prefix up to the end of its block. A new prompt walks its own chain and takes the
longest run of published blocks whose tokens are its own, each published under the block
it matched before (a block holds its parent block itself, not its key, so a hash
collision, or a key published again after its block left the cache, is a miss): their
pages are shared (reference counts; a shared page is full and never written again), and
the Mamba conv/SSM state at the end of the run comes from a *snapshot* saved when the
block was computed. Snapshots are large (H·P·N·4 bytes
per Mamba layer), so they live in a bounded pool of their own and a block may lack one; a
hit ends at the deepest block of the run that has one (models without Mamba layers need
none). Example, block size 4, a cached prompt ``a b c d | e f g h | i j k l``::

    new prompt  a b c d | e f g h | i j x y | z     blocks 0, 1 match; block 2 differs
    snapshots   -         yes       -               the hit ends at block 1: 8 tokens
    computed    from position 8, starting from the snapshot of block 1

A prompt is never hit whole: its last token must run to give the logits of the first new
token, so the hit stops at least one token short (a fully cached prompt backs off a block
and recomputes it from the snapshot before it, which keeps the states exact).

Eviction is LRU in both pools. A published page nobody holds stays cached until a page is
needed and none is free; then the least recently released one goes (its block, and its
snapshot, leave the cache). A sequence gives its pages back deepest block first, so a
chain is evicted from its end and what stays of it is still reachable (a block whose
parent left the cache can no longer be hit). A snapshot a waiting sequence will restore
is pinned until its step has run; one taken for a step and not yet published or given
back is outstanding, and ``clear_cache`` leaves it out of the free list.

Admission reserves every page a sequence can need (prompt + new tokens − 1 keys), so a
running sequence never waits for a page: the engine admits a request only when the pool
(free and evictable pages, less those promised) holds its reservation.

An engine whose slots are split into dp groups (a ``"dp"`` mesh axis) has one
``BlockManager`` per group behind a ``GroupedBlockManager``: each group's pages, snapshots
and published blocks are its own (they live on its devices), so a prefix hits only in the
group that computed it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["BlockHashes", "BlockManager", "GroupedBlockManager", "PrefixHit"]


class BlockHashes:
    """The hash chain of one token sequence's full blocks, ``key_i = hash((key_{i-1},
    tokens of block i))``, computed as far as it is asked for and kept: a request holds one
    from its admission on, and the ``BlockManager`` extends it over the request's tokens
    (prompt, then generated) whenever a lookup, an admission, a snapshot or a publication
    needs a deeper key. Indexing gives the keys computed so far."""

    def __init__(self, block_size: int, keys: Sequence[int] = ()):
        self.block_size = block_size
        self._keys: list[int] = list(keys)  # a chain computed before, if any

    def extend(self, tokens: Sequence[int], num_blocks: int) -> BlockHashes:
        """Computes the keys of the first ``num_blocks`` full blocks of ``tokens`` (the same
        tokens as earlier calls, possibly longer) that are not computed yet."""
        bs = self.block_size
        for i in range(len(self._keys), num_blocks):
            parent = self._keys[i - 1] if i else None
            self._keys.append(hash((parent, tuple(tokens[i * bs : (i + 1) * bs]))))
        return self

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, index):
        return self._keys[index]


@dataclasses.dataclass(eq=False)
class _Block:
    """A published block: the published block before it in its chain (None for a first
    block; compared by identity), its tokens, its page, and the snapshot of the state at
    its end (or None)."""

    parent: _Block | None
    tokens: tuple[int, ...]
    page: int
    snapshot: int | None = None


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """What ``BlockManager.admit`` gave a sequence: ``tokens`` already computed (a multiple
    of the block size) and the ``snapshot`` to restore its Mamba state from (None when
    nothing hit or the model has no Mamba state)."""

    tokens: int
    snapshot: int | None


class BlockManager:
    """Pages, per-slot block tables, published blocks and snapshots of one engine.

    Args:
      num_pages: pages in the KV pool.
      block_size: tokens per page (a multiple of the Mamba chunk size for prefix caching).
      num_slots: cache slots (rows of ``tables``).
      max_blocks: table columns, ``cdiv(max_len, block_size)``.
      num_snapshots: entries of the snapshot pool (0: no snapshots).
      prefix_caching: publish blocks and match prompts against them.
      needs_state: the model has Mamba layers: a hit needs a snapshot at its last block.

    Attributes:
      tables: int32[num_slots, max_blocks], each slot's pages (-1: none); ``version`` counts
        its changes (the engine copies it to the device when it moved).
      evicted_pages, evicted_snapshots: cached pages and snapshots reused for new content.
    """

    def __init__(
        self,
        *,
        num_pages: int,
        block_size: int,
        num_slots: int,
        max_blocks: int,
        num_snapshots: int,
        prefix_caching: bool,
        needs_state: bool,
    ):
        self.num_pages, self.block_size = num_pages, block_size
        self.num_snapshots = num_snapshots
        self.prefix_caching, self.needs_state = prefix_caching, needs_state
        self.tables = np.full((num_slots, max_blocks), -1, np.int32)
        self.version = 0
        self.evicted_pages = self.evicted_snapshots = 0
        self.reset()

    def reset(self) -> None:
        """Every page and snapshot free, nothing published (the caches were lost)."""
        self.tables[:] = -1
        self.version += 1
        self._pages: list[list[int]] = [[] for _ in range(self.tables.shape[0])]
        self._refs = np.zeros(self.num_pages, np.int32)
        self._free = collections.deque(range(self.num_pages))
        self._blocks: dict[int, _Block] = {}
        self._page_block: dict[int, int] = {}  # published page -> its block's key
        # Published pages no sequence holds, least recently released first.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._reserved = np.zeros(self.tables.shape[0], np.int64)  # promised, not taken
        self._free_snapshots = collections.deque(range(self.num_snapshots))
        # Snapshots holding a block's state, least recently used first.
        self._snapshot_block: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._pinned: dict[int, int] = {}  # slot -> snapshot it will restore
        # Snapshots taken for a step, not yet published or given back.
        self._outstanding: set[int] = set()
        # Each slot's published blocks, in order, as far as the sequence there matched or
        # published them (None: a block it could not publish); the parents of its next.
        self._chains: list[list[_Block | None]] = [[] for _ in range(self.tables.shape[0])]

    def clear_cache(self) -> None:
        """Forgets every published block and snapshot (pages held by running sequences
        stay theirs; snapshots taken for a step and not yet published or given back stay
        out of the free list). Not while a restore is pending."""
        if self._pinned:
            raise RuntimeError("a sequence waits to restore a snapshot; clear between runs")
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._blocks.clear()
        self._page_block.clear()
        self._snapshot_block.clear()
        self._free_snapshots = collections.deque(
            s for s in range(self.num_snapshots) if s not in self._outstanding
        )

    # ------------------------------------------------------------------------ counts

    @property
    def num_free_pages(self) -> int:
        """Pages no sequence holds (free, or cached and evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_snapshots(self) -> int:
        return len(self._free_snapshots)

    @property
    def num_cached_snapshots(self) -> int:
        """Snapshots holding a published block's state."""
        return len(self._snapshot_block)

    def slot_pages(self, slot: int) -> list[int]:
        return list(self._pages[slot])

    def snapshot_of(self, key: int) -> int | None:
        """The snapshot entry of the published block ``key`` (None: none, or unpublished)."""
        block = self._blocks.get(key)
        return None if block is None else block.snapshot

    # ------------------------------------------------------------------------ sequences

    def lookup(self, tokens: Sequence[int], keys: BlockHashes) -> tuple[int, int | None]:
        """``(blocks, snapshot)`` of the longest usable cached prefix of ``tokens`` (whose
        chain is ``keys``, extended as far as the lookup needs); touches nothing else."""
        return self._lookup(tokens, keys)[:2]

    def _lookup(
        self, tokens: Sequence[int], keys: BlockHashes
    ) -> tuple[int, int | None, list[_Block]]:
        """``lookup``, and the matched blocks of the hit."""
        if not self.prefix_caching:
            return 0, None, []
        bs, best, snapshot, parent = self.block_size, 0, None, None
        keys.extend(tokens, (len(tokens) - 1) // bs)
        chain: list[_Block] = []
        for i in range((len(tokens) - 1) // bs):
            block = self._blocks.get(keys[i])
            if (
                block is None
                or block.parent is not parent
                or block.tokens != tuple(tokens[i * bs : (i + 1) * bs])
            ):
                break  # a hash collision counts as a miss
            chain.append(block)
            if not self.needs_state or block.snapshot is not None:
                best, snapshot = i + 1, block.snapshot
            parent = block
        return best, snapshot, chain[:best]

    def admit(
        self, slot: int, tokens: Sequence[int], keys: BlockHashes, max_tokens: int
    ) -> PrefixHit | None:
        """Takes slot ``slot`` (empty) for a sequence of prompt ``tokens`` that will hold
        ``max_tokens`` keys: shares the pages of its cached prefix and reserves the rest.
        None (nothing changed) when the pool cannot hold the reservation now."""
        if self._pages[slot]:
            raise ValueError(f"slot {slot} holds pages; release it first")
        if self.prefix_caching:  # every full prompt block's key: in flight once admitted
            keys.extend(tokens, len(tokens) // self.block_size)
        hit, snapshot, chain = self._lookup(tokens, keys)
        pages = [block.page for block in chain]
        need = -(-max_tokens // self.block_size) - hit
        unheld = sum(1 for page in pages if self._refs[page] == 0)  # leave the evictable set
        if self.num_free_pages - unheld - int(self._reserved.sum()) < need:
            return None
        for page in pages:
            self._refs[page] += 1
            self._evictable.pop(page, None)
        self._pages[slot] = pages
        self._chains[slot] = list(chain)
        self.tables[slot, :hit] = pages
        self.version += 1
        self._reserved[slot] = need
        if snapshot is not None:
            self._pinned[slot] = snapshot
            self._snapshot_block.move_to_end(snapshot)
        return PrefixHit(hit * self.block_size, snapshot)

    def ensure(self, slot: int, num_tokens: int) -> None:
        """Gives slot ``slot`` pages for its first ``num_tokens`` keys; RuntimeError when
        the pool has no page left (only for slots that reserved none: direct steps)."""
        needed = -(-num_tokens // self.block_size)
        if needed > self.tables.shape[1]:
            raise ValueError(
                f"slot {slot}: {num_tokens} tokens exceed the block table "
                f"({self.tables.shape[1]} blocks of {self.block_size})"
            )
        pages = self._pages[slot]
        while len(pages) < needed:
            if self._reserved[slot] > 0:
                self._reserved[slot] -= 1
            elif self.num_free_pages - int(self._reserved.sum()) <= 0:
                raise RuntimeError(
                    f"the KV page pool is exhausted ({self.num_pages} pages of "
                    f"{self.block_size} tokens); raise num_kv_blocks"
                )
            page = self._take_page()
            self._refs[page] = 1
            self.tables[slot, len(pages)] = page
            pages.append(page)
            self.version += 1

    def restored(self, slot: int) -> None:
        """The step that restored slot ``slot``'s snapshot ran: unpin it."""
        self._pinned.pop(slot, None)

    def release(self, slot: int) -> None:
        """Gives back slot ``slot``'s pages, reservation and pin; published pages nobody
        holds stay cached (most recently released last in the LRU order, deepest block
        first: a chain is evicted from its end)."""
        self._chains[slot] = []
        for page in reversed(self._pages[slot]):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._page_block:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        if self._pages[slot]:
            self._pages[slot] = []
            self.tables[slot] = -1
            self.version += 1
        self._reserved[slot] = 0
        self._pinned.pop(slot, None)

    def _take_page(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._evictable.popitem(last=False)
        self.evicted_pages += 1
        block = self._blocks.pop(self._page_block.pop(page))
        if block.snapshot is not None:
            del self._snapshot_block[block.snapshot]
            self._free_snapshots.append(block.snapshot)
        return page

    # ------------------------------------------------------------------------ publishing

    def wants_snapshot(self, tokens: Sequence[int], keys: BlockHashes, block: int) -> bool:
        """Whether the state at the end of ``block`` should be saved: prefix caching of a
        model with Mamba state, and no snapshot of this block cached yet."""
        if not (self.prefix_caching and self.needs_state and self.num_snapshots):
            return False
        cached = self._blocks.get(keys.extend(tokens, block + 1)[block])
        return cached is None or cached.snapshot is None

    def take_snapshot(self) -> int | None:
        """A free snapshot entry (evicting the least recently used unpinned one), or None."""
        if self._free_snapshots:
            snapshot = self._free_snapshots.popleft()
            self._outstanding.add(snapshot)
            return snapshot
        pinned = set(self._pinned.values())
        for snapshot, key in self._snapshot_block.items():
            if snapshot not in pinned:
                del self._snapshot_block[snapshot]
                self._blocks[key].snapshot = None
                self.evicted_snapshots += 1
                self._outstanding.add(snapshot)
                return snapshot
        return None

    def give_back_snapshots(self, snapshots: Sequence[int]) -> None:
        """Returns snapshot entries taken for a step that did not run or saved nothing
        kept (entries not outstanding, e.g. after a ``reset``, are left alone)."""
        for snapshot in snapshots:
            if snapshot in self._outstanding:
                self._outstanding.discard(snapshot)
                self._free_snapshots.append(snapshot)

    def publish(
        self,
        slot: int,
        tokens: Sequence[int],
        keys: BlockHashes,
        blocks: range,
        snapshots: dict[int, int],
    ) -> None:
        """Publishes full ``blocks`` of the sequence in ``slot`` (``tokens``, chain
        ``keys``) with the snapshots saved at their ends (block -> entry; entries not kept
        go back to the free pool). A block is published under the block its sequence
        matched or published before it; one whose key holds another chain's block (a hash
        collision), or whose parent is unknown or left the cache, is not."""
        bs, chain = self.block_size, self._chains[slot]
        keys.extend(tokens, blocks.stop)
        for i in blocks:
            snapshot = snapshots.get(i)
            page, key = self._pages[slot][i], keys[i]
            parent = chain[i - 1] if 0 < i <= len(chain) else None
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            cached = None
            # Its parent still cached (not evicted, not cleared): else it is unreachable.
            if i == 0 or (parent is not None and self._blocks.get(keys[i - 1]) is parent):
                cached = self._blocks.get(key)
                if cached is None:  # the sequence's own page, never published before
                    cached = self._blocks[key] = _Block(parent, block_tokens, page)
                    self._page_block[page] = key
                elif cached.parent is not parent or cached.tokens != block_tokens:
                    cached = None  # a collision: another chain's block
            del chain[i:]
            chain.extend([None] * (i - len(chain)))
            chain.append(cached)
            if snapshot is None:
                continue
            if cached is not None and cached.snapshot is None:
                self._outstanding.discard(snapshot)
                cached.snapshot = snapshot
                self._snapshot_block[snapshot] = key
            else:
                self.give_back_snapshots([snapshot])


def _summed(name: str) -> property:
    """A ``GroupedBlockManager`` property: the ``BlockManager`` property ``name`` summed
    over the groups."""
    return property(lambda self: sum(getattr(m, name) for m in self.groups))


class GroupedBlockManager:
    """The pages of an engine whose slots are split into groups (a ``"dp"`` mesh axis), one
    ``BlockManager`` per group: group g owns the slots ``[g·S/G, (g+1)·S/G)``, its own
    pages (``num_pages / G``, numbered from 0 in the group: they index its share of the
    pool, which its devices hold), its own snapshot entries and its own prefix cache (a
    prefix computed in one group hits only there). Slot and snapshot ids here are global
    (group g's entries are ``[g·Q/G, (g+1)·Q/G)``); page ids in ``tables`` are the groups'.

    Attributes:
      groups: the per-group managers (local ids: ``slot - g·S/G``, ``entry - g·Q/G``).
      tables: int32[S, max_blocks], every slot's pages (group-local ids; -1: none), and
        ``version``, which moves when any group's table does.
    """

    def __init__(self, groups: Sequence[BlockManager]):
        self.groups = list(groups)
        self.slots_per_group = self.groups[0].tables.shape[0]
        self.snapshots_per_group = self.groups[0].num_snapshots
        self.block_size = self.groups[0].block_size
        self.num_pages = sum(m.num_pages for m in self.groups)
        self.num_snapshots = sum(m.num_snapshots for m in self.groups)

    def _of(self, slot: int) -> tuple[BlockManager, int]:
        """The manager of ``slot``'s group and its slot id there."""
        group, local = divmod(slot, self.slots_per_group)
        return self.groups[group], local

    def global_snapshot(self, group: int, entry: int | None) -> int | None:
        """Group ``group``'s snapshot ``entry`` as a global id."""
        return None if entry is None else group * self.snapshots_per_group + entry

    def local_snapshot(self, snapshot: int) -> tuple[int, int]:
        """``(group, entry)``: the global snapshot id as its group's own id."""
        return divmod(snapshot, self.snapshots_per_group)

    def _local_snapshots(self, snapshots: Sequence[int]) -> dict[int, list[int]]:
        """Global snapshot ids by group, as the groups' own ids."""
        by_group: dict[int, list[int]] = {}
        for snapshot in snapshots:
            group, entry = self.local_snapshot(snapshot)
            by_group.setdefault(group, []).append(entry)
        return by_group

    @property
    def tables(self) -> np.ndarray:
        return np.concatenate([m.tables for m in self.groups])

    @property
    def version(self) -> int:
        return sum(m.version for m in self.groups)

    @property
    def prefix_caching(self) -> bool:
        return self.groups[0].prefix_caching

    @prefix_caching.setter
    def prefix_caching(self, enabled: bool) -> None:
        for m in self.groups:
            m.prefix_caching = enabled

    # Counts over every group.
    num_free_pages = _summed("num_free_pages")
    num_free_snapshots = _summed("num_free_snapshots")
    num_cached_blocks = _summed("num_cached_blocks")
    num_cached_snapshots = _summed("num_cached_snapshots")
    evicted_pages = _summed("evicted_pages")
    evicted_snapshots = _summed("evicted_snapshots")

    def reset(self) -> None:
        for m in self.groups:
            m.reset()

    def clear_cache(self) -> None:
        for m in self.groups:
            m.clear_cache()

    def slot_pages(self, slot: int) -> list[int]:
        manager, local = self._of(slot)
        return manager.slot_pages(local)

    def admit(
        self, slot: int, tokens: Sequence[int], keys: BlockHashes, max_tokens: int
    ) -> PrefixHit | None:
        """``BlockManager.admit`` in ``slot``'s group (its prefix cache, its pages)."""
        manager, local = self._of(slot)
        hit = manager.admit(local, tokens, keys, max_tokens)
        if hit is None:
            return None
        group = slot // self.slots_per_group
        return PrefixHit(hit.tokens, self.global_snapshot(group, hit.snapshot))

    def ensure(self, slot: int, num_tokens: int) -> None:
        manager, local = self._of(slot)
        manager.ensure(local, num_tokens)

    def restored(self, slot: int) -> None:
        manager, local = self._of(slot)
        manager.restored(local)

    def release(self, slot: int) -> None:
        manager, local = self._of(slot)
        manager.release(local)

    def give_back_snapshots(self, snapshots: Sequence[int]) -> None:
        for group, entries in self._local_snapshots(snapshots).items():
            self.groups[group].give_back_snapshots(entries)

    def publish(
        self,
        slot: int,
        tokens: Sequence[int],
        keys: BlockHashes,
        blocks: range,
        snapshots: dict[int, int],
    ) -> None:
        """``BlockManager.publish`` in ``slot``'s group; ``snapshots`` are global ids of
        entries taken from that group."""
        manager, local = self._of(slot)
        local_snapshots = {b: self.local_snapshot(e)[1] for b, e in snapshots.items()}
        manager.publish(local, tokens, keys, blocks, local_snapshots)
