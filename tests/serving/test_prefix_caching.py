"""Paged KV caches and chunk-granular prefix caching in the engine (CPU, tiny fixtures)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from flax import nnx

from flax_models.cache import MambaCache, ParallelCache
from flax_models.config import HybridConfig
from flax_models.model import HybridLM
from flax_models.serving.batching import Request
from flax_models.serving.engine import Engine
from flax_models.serving.prefix_cache import BlockHashes, BlockManager
from flax_models.serving.request import SequenceState
from flax_models.serving.sampling import SamplingParams
from pallas_kernels.testing import assert_close
from tests.serving.test_engine import backend_compiles, model, program_count, random_prompts

# Compiling dominates these tests, so engines are shared (``engine``) and each compiles
# at most three programs: prefill-only, decode-only and mixed steps. A budget of 12 tokens
# in a 16-token bucket puts prefill chunk ends off the block boundaries (chunked prefill).
SMALL = dict(max_slots=2, max_len=64, token_budget=12, decode_buckets=(2,), token_buckets=(16,))
# One of each layer layout: attention + Mamba2 with MLPs (bamba), separate M/*/- blocks
# (nemotronh), parallel attention ∥ Mamba2 with a block of two chunks (falcon_h1), MoE
# (granitemoehybrid_moe), and no attention at all (mamba2).
LAYOUTS = ["bamba", "nemotronh", "falcon_h1", "granitemoehybrid_moe", "mamba2"]
_ENGINES: dict[tuple, Engine] = {}


def engine(family: str = "bamba", **options) -> Engine:
    """A shared engine over ``family``'s fixture: ``SMALL`` with ``options``."""
    key = (family, *sorted(options.items()))
    if key not in _ENGINES:
        _ENGINES[key] = Engine(model(family), **(SMALL | options))
    return _ENGINES[key]


def cached_engine(family: str = "bamba") -> Engine:
    """Prefix caching over 8 snapshots; one slot (two programs) but for bamba."""
    cs = model(family).cfg.mamba_chunk_size
    block = 2 * cs if family == "falcon_h1" else cs
    slots = {} if family == "bamba" else dict(max_slots=1, decode_buckets=(1,))
    return engine(family, prefix_caching=True, kv_block_size=block, num_prefix_snapshots=8, **slots)


_EXPECTED: dict[str, list[list[int]]] = {}


def computed_alone(family: str, prompts: list[list[int]]) -> list[list[int]]:
    """5 greedy tokens of each prompt, computed alone on an empty prefix cache."""
    if family not in _EXPECTED:
        cached = cached_engine(family)
        _EXPECTED[family] = []
        for prompt in prompts:
            cached.clear_prefix_cache()
            _EXPECTED[family].append(cached.generate([prompt], 5)[0])
        cached.clear_prefix_cache()
    return _EXPECTED[family]


def shared_prefix_prompts(rng, vocab: int, block: int) -> list[list[int]]:
    """Prompts sharing prefixes of 1-3 blocks (one of exactly two blocks, one repeated
    whole), with unique tails of 0-9 tokens; at most 3 blocks + 1 token."""
    roots = random_prompts(rng, vocab, (3 * block, 2 * block + 5))
    prompts = []
    for n_blocks, root, tail in ((2, 0, 3), (3, 0, 1), (2, 0, 0), (1, 1, 9), (2, 1, 5), (2, 0, 3)):
        prompts.append(roots[root][: n_blocks * block] + random_prompts(rng, vocab, (tail,))[0])
    prompts.append(list(prompts[0]))
    return prompts


def mamba_caches(engine: Engine) -> list[MambaCache]:
    caches = [c.mamba if isinstance(c, ParallelCache) else c for c in engine.caches]
    return [c for c in caches if isinstance(c, MambaCache)]


@pytest.mark.parametrize("family", LAYOUTS)
def test_cached_generation_gives_the_tokens_of_computing_everything(family):
    """Each prompt alone on an empty prefix cache, then all of them in one generation,
    sharing prefixes (8 snapshots for up to 11 block ends: LRU snapshot evictions)."""
    cached = cached_engine(family)
    bs = cached.block_size
    assert 3 * bs + 6 <= cached.builder.max_len
    prompts = shared_prefix_prompts(np.random.default_rng(0), cached.cfg.vocab_size, bs)
    expected = computed_alone(family, prompts)
    before = dict(cached.stats)
    assert cached.generate(prompts, 5) == expected
    hits = cached.stats["prefix_hits"] - before["prefix_hits"]
    assert hits >= 2  # prompts 2 (all cached: backs off one block) and 5 at least
    assert cached.blocks.num_free_pages == cached.blocks.num_pages
    hit_tokens = cached.stats["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    assert cached.generate(prompts, 5) == expected  # again, more of it cached
    assert cached.stats["prefix_hit_tokens"] - before["prefix_hit_tokens"] > 2 * hit_tokens
    assert cached.blocks.num_free_pages == cached.blocks.num_pages


def test_a_small_pool_waits_evicts_and_gives_the_uncached_tokens(monkeypatch):
    """Four pages of 16 tokens hold one long sequence: others wait for pages, published
    pages and both snapshots are reused all along; the tokens are those computed without
    a cached prefix. A request the pool can never hold is refused before any step,
    and an interrupted generation gives its pages back."""
    m = model("bamba")
    prompts = shared_prefix_prompts(np.random.default_rng(0), m.cfg.vocab_size, 16)
    expected = computed_alone("bamba", prompts)
    small = engine(
        "bamba", max_len=80, prefix_caching=True, num_kv_blocks=4, num_prefix_snapshots=2
    )
    assert small.generate(prompts, 5) == expected
    assert small.blocks.num_free_pages == 4
    assert small.stats["prefix_hits"] > 0
    assert small.blocks.evicted_pages > 0 and small.blocks.evicted_snapshots > 0
    steps = small.compile_count
    with pytest.raises(ValueError, match="need 5 KV pages .* num_kv_blocks=4"):
        small.generate([prompts[1], [1] * 70], 4)
    with pytest.raises(ValueError, match="token id"):
        small.generate([prompts[0], [m.cfg.vocab_size]], 3)

    real_jitted, calls = small.runner.step_program, []

    def interrupted(*args, **kwargs):
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_jitted(*args, **kwargs)

    monkeypatch.setattr(small.runner, "step_program", interrupted)
    with pytest.raises(KeyboardInterrupt):
        small.generate(prompts, 5)
    monkeypatch.setattr(small.runner, "step_program", real_jitted)
    assert small.blocks.num_free_pages == 4
    assert small.generate(prompts, 5) == expected
    assert small.compile_count == steps


def test_hit_counts_and_no_recompilation():
    bs = model("bamba").cfg.mamba_chunk_size
    cached = cached_engine("bamba")
    compiled = cached.warmup()
    assert compiled == program_count(cached)
    cached.clear_prefix_cache()
    two_blocks = random_prompts(np.random.default_rng(2), cached.cfg.vocab_size, (2 * bs,))[0]
    hits = []

    def run(prompt, new=4):
        before = dict(cached.stats)
        generated = cached.generate([prompt], new)[0]
        hits.append(cached.stats["prefix_hit_tokens"] - before["prefix_hit_tokens"])
        return generated

    with backend_compiles() as after_warmup:
        first = run(two_blocks + [1, 2, 3], new=bs)  # nothing cached; 50 keys, 3 blocks
        run(two_blocks + [4, 5])  # the same two blocks
        run(two_blocks)  # all cached: recompute the last block from the first's state
        run([(two_blocks[0] + 1) % cached.cfg.vocab_size, *two_blocks[1:], 4, 5])  # differs
        # Block 2 of the first prompt ([1, 2, 3] and 13 generated tokens) ended in a decode
        # row: decode boundaries are published too.
        run(two_blocks + [1, 2, 3] + first[:13] + [8])
    assert hits == [0, 2 * bs, bs, 0, 3 * bs]
    assert after_warmup == []
    assert cached.compile_count == compiled
    assert cached.blocks.num_free_pages == cached.blocks.num_pages


def test_snapshots_are_the_states_at_block_ends():
    """Each saved snapshot equals the conv/SSM state of an uncached prefill of exactly the
    prompt up to that block's end (chunked prefill crossing the boundary mid-step, and a
    boundary reached by decode rows)."""
    cached = cached_engine("nemotronh")
    bs = cached.block_size
    prompt = random_prompts(np.random.default_rng(3), cached.cfg.vocab_size, (2 * bs + 5,))[0]
    cached.clear_prefix_cache()
    generated = cached.generate([prompt], bs)[0]
    tokens = prompt + generated
    keys = BlockHashes(bs).extend(tokens, 3)
    reference = engine("nemotronh")
    done = 0
    for end_block in range(3):
        end = (end_block + 1) * bs
        while done < end:  # prefill exactly up to the block end, in steps of <= 12
            count = min(12, end - done)
            chunk = tokens[done : done + count]
            reference.step(reference.builder.build([], [Request(0, chunk, done)]))
            done += count
        entry = cached.blocks.snapshot_of(keys[end_block])
        assert entry is not None
        for layer, (saved, fresh) in enumerate(
            zip(mamba_caches(cached), mamba_caches(reference), strict=True)
        ):
            where = f"layer {layer}, block {end_block}"
            assert_close(saved.snapshot_ssm[entry], fresh.ssm_state[0], rtol=1e-5, name=where)
            assert_close(saved.snapshot_conv[entry], fresh.conv_state[0], rtol=1e-5, name=where)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(kv_block_size=0), "kv_block_size"),
        (dict(kv_block_size=24, prefix_caching=True), "multiple of the Mamba chunk size"),
        (dict(num_kv_blocks=0), "num_kv_blocks"),
        (dict(prefix_caching=True, num_prefix_snapshots=0), "num_prefix_snapshots"),
        (dict(num_prefix_snapshots=4), "num_prefix_snapshots=4 needs prefix_caching=True"),
    ],
)
def test_paging_settings_are_checked(options, match):
    with pytest.raises(ValueError, match=match):
        Engine(model("bamba"), **(SMALL | options))


def test_snapshots_are_refused_for_a_model_without_mamba_layers():
    attention_only = HybridLM(HybridConfig.tiny(layer_pattern="*"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_prefix_snapshots=4 needs a model with Mamba"):
        Engine(attention_only, **SMALL, prefix_caching=True, num_prefix_snapshots=4)


def test_an_attention_only_model_caches_chunk_sized_blocks_by_default():
    """DESIGN §8: the block size defaults to the model's chunk size, so any shared prefix
    of a chunk or more hits, for a model without Mamba layers too (before: 256-token
    blocks there, and a 30-token repeat with chunk size 16 hit nothing)."""
    attention_only = HybridLM(HybridConfig.tiny(layer_pattern="*-*"), rngs=nnx.Rngs(0))
    cs = attention_only.cfg.mamba_chunk_size
    cached = Engine(attention_only, **SMALL, prefix_caching=True)
    assert cached.blocks.block_size == cs
    prompts = random_prompts(np.random.default_rng(5), attention_only.cfg.vocab_size, (2 * cs - 2,))
    first = cached.generate(prompts, 3)
    hits = cached.stats["prefix_hit_tokens"]
    assert cached.generate(prompts, 3) == first
    assert cached.stats["prefix_hit_tokens"] - hits == cs


def _snapshots_accounted(blocks: BlockManager) -> bool:
    """Every snapshot entry is free or a published block's, once."""
    return blocks.num_free_snapshots + blocks.num_cached_snapshots == blocks.num_snapshots


def test_a_stream_stopped_within_a_step_leaves_no_snapshot_behind():
    """Two 19-token prompts, 12-token budget: the third step decodes request 0 and takes a
    snapshot for request 1's block end; the stream stops at request 0's event of that step
    (close, or the stop callback raising) before request 1's event."""
    cached = cached_engine("bamba")
    bs = cached.block_size
    prompts = random_prompts(np.random.default_rng(7), cached.cfg.vocab_size, (bs + 3, bs + 3))
    sampling = SamplingParams(max_new_tokens=3, temperature=0.0)
    for events in range(1, 5):
        cached.clear_prefix_cache()
        stream = cached.stream(prompts, sampling)
        for _ in range(events):
            next(stream)
        stream.close()
        assert _snapshots_accounted(cached.blocks), events
        assert cached.blocks.num_free_pages == cached.blocks.num_pages

    calls = []

    def stop(index, token):
        calls.append(index)
        if len(calls) == 2:
            raise RuntimeError("stop callback failed")
        return False

    cached.clear_prefix_cache()
    with pytest.raises(RuntimeError, match="stop callback failed"):
        list(cached.stream(prompts, sampling, stop=stop))
    assert _snapshots_accounted(cached.blocks)
    assert cached.blocks.num_free_pages == cached.blocks.num_pages


def test_internal_a_waiting_prompt_ignores_keys_past_its_usable_blocks():
    """A one-block prompt has no block to hit (its last token must run): it never waits
    for a running prompt computing that block, whatever keys an earlier admission attempt
    left in its chain."""
    cached = cached_engine("bamba")
    bs = cached.block_size
    cached.clear_prefix_cache()
    long = random_prompts(np.random.default_rng(8), cached.cfg.vocab_size, (2 * bs + 1,))[0]
    running = SequenceState(0, long, SamplingParams(), frozenset(), BlockHashes(bs))
    running.hashes.extend(long, 2)  # computing blocks 0 and 1 now
    waiting = SequenceState(1, long[:bs], SamplingParams(), frozenset(), BlockHashes(bs))
    waiting.hashes.extend(waiting.prompt, 1)  # what a failed admission leaves
    queue = collections.deque([waiting])
    assert cached.scheduler.next_admissible(queue, [running]) is waiting


def test_pages_grow_with_the_sequence_and_come_back():
    uncached = cached_engine("bamba")
    bs = uncached.block_size
    slot = uncached.allocate_slot()
    uncached.step(uncached.builder.build([], [Request(slot, [3] * 12, 20)]))  # keys 0..31
    assert len(uncached.blocks.slot_pages(slot)) == 2 == -(-32 // bs)
    uncached.release_slot(slot)
    assert uncached.blocks.num_free_pages == uncached.blocks.num_pages
    uncached.generate([[5] * (bs + 1)], 3)
    assert uncached.blocks.num_free_pages == uncached.blocks.num_pages


def _block_manager(num_pages: int, *, num_snapshots: int = 0) -> BlockManager:
    return BlockManager(
        num_pages=num_pages,
        block_size=2,
        num_slots=2,
        max_blocks=4,
        num_snapshots=num_snapshots,
        prefix_caching=True,
        needs_state=bool(num_snapshots),
    )


def test_a_chain_is_evicted_from_its_deepest_block():
    blocks = _block_manager(4)
    tokens = list(range(7))  # three blocks and a token
    keys = BlockHashes(2)
    blocks.admit(0, tokens, keys, 7)
    blocks.ensure(0, 7)
    blocks.publish(0, tokens, keys, range(3), {})
    blocks.release(0)
    other = [50, 51, 52]  # two pages: the free one and one evicted
    blocks.admit(1, other, BlockHashes(2), 3)
    blocks.ensure(1, 3)
    assert blocks.evicted_pages == 1 and blocks.num_cached_blocks == 2
    assert blocks.lookup(tokens, keys) == (2, None)  # blocks 0 and 1 are still a chain


def test_a_block_is_hit_only_under_the_parent_it_was_published_under():
    """Block [3, 4] was published after [1, 2]; [1, 2] leaves the cache and its key is
    published again for [7, 8] (a hash collision, forced): [7, 8, 3, 4] hits one block."""
    blocks = _block_manager(3)
    a = [1, 2, 3, 4, 5]
    keys_a = BlockHashes(2).extend(a, 2)
    blocks.admit(0, a, keys_a, 5)
    blocks.ensure(0, 5)
    blocks.publish(0, a, keys_a, range(2), {})
    root_page = blocks.slot_pages(0)[0]
    blocks.release(0)
    blocks._evictable.move_to_end(root_page, last=False)  # the root goes first
    b, keys_b = [7, 8, 9], BlockHashes(2, keys_a[:1])  # a's key for b's block
    blocks.admit(1, b, keys_b, 3)
    blocks.ensure(1, 3)
    blocks.publish(1, b, keys_b, range(1), {})
    blocks.release(1)
    assert blocks.lookup([7, 8, 3, 4, 6], keys_a) == (1, None)


def test_clearing_keeps_snapshots_taken_for_a_step_out_of_the_free_list():
    blocks = _block_manager(2, num_snapshots=2)
    taken = blocks.take_snapshot()
    blocks.clear_cache()  # (a stream suspended between taking and publishing)
    assert blocks.num_free_snapshots == 1
    other = blocks.take_snapshot()
    assert other != taken and blocks.take_snapshot() is None
    tokens = [1, 2, 3]
    keys = BlockHashes(2)
    blocks.admit(0, tokens, keys, 3)
    blocks.ensure(0, 3)
    blocks.publish(0, tokens, keys, range(1), {0: taken})
    blocks.give_back_snapshots([other, other])
    assert blocks.snapshot_of(keys[0]) == taken
    assert _snapshots_accounted(blocks) and blocks.num_free_snapshots == 1
    blocks.release(0)


def test_block_manager_shares_reserves_and_evicts_least_recently_released():
    bs = 4
    blocks = BlockManager(
        num_pages=6,
        block_size=bs,
        num_slots=3,
        max_blocks=6,
        num_snapshots=2,
        prefix_caching=True,
        needs_state=True,
    )
    a = list(range(12))  # three blocks
    keys_a = BlockHashes(bs)
    assert blocks.admit(0, a, keys_a, max_tokens=13).tokens == 0
    blocks.ensure(0, 12)
    assert blocks.tables[0, :3].tolist() == blocks.slot_pages(0) and blocks.num_free_pages == 3
    # 4 pages reserved for slot 0, 2 held elsewhere: a 3-page request must wait.
    assert blocks.admit(1, [50] * 9, BlockHashes(bs), max_tokens=12) is None
    snaps = [blocks.take_snapshot(), blocks.take_snapshot()]
    assert blocks.take_snapshot() is None  # both in use, none published yet
    blocks.publish(0, a, keys_a, range(3), {0: snaps[0], 2: snaps[1]})
    blocks.release(0)
    assert blocks.num_free_pages == 6 and blocks.num_cached_blocks == 3
    # a's first two blocks hit; block 1 has no snapshot, so the hit ends at block 0.
    b = a[:8] + [99]
    hit = blocks.admit(1, b, BlockHashes(bs), max_tokens=9)
    assert (hit.tokens, hit.snapshot) == (4, snaps[0])
    # The pinned snapshot is never handed out; the other is (LRU), unpublishing block 2.
    assert blocks.take_snapshot() == snaps[1]
    assert blocks.take_snapshot() is None
    blocks.restored(1)
    assert blocks.take_snapshot() == snaps[0]  # unpinned now: block 0 loses its snapshot
    blocks.release(1)
    # Pages: 3 cached (refcount 0) + 3 free; a 6-page need evicts all cached, LRU first.
    c = [7] * 23
    assert blocks.admit(2, c, BlockHashes(bs), max_tokens=24).tokens == 0
    blocks.ensure(2, 24)
    assert blocks.num_cached_blocks == 0 and blocks.num_free_pages == 0
    with pytest.raises(RuntimeError, match="exhausted"):
        blocks.ensure(0, 1)
    blocks.release(2)
    assert blocks.num_free_pages == 6
    assert (blocks.tables == -1).all()
