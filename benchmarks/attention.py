"""Masked-tail attention (``masked_tail_attention``) benchmarks.

``python -m benchmarks.attention [--out FILE] [--results-dir DIR] [--quick] [--only PROBLEM ...]
[--paged-only] [--page-size 256]``. Problems: dense causal prefill, a ragged batch whose KV
tails are mostly masked, chunked prefill on long cached prefixes, and decode over ragged KV
lengths; ``--quick`` shrinks them for a CPU smoke run.

Paged rows (``<impl>-paged``, every Pallas backend): the same problem on the same keys and
values copied into a page pool (``block_table``; pages of ``--page-size`` keys, 16 with
``--quick``) holding only the pages the sequences use, in shuffled order; each such row
carries ``paged_over_contiguous``, its time over the contiguous row's. ``--paged-only``
runs just the Pallas backends' contiguous and paged rows (no xla, no cuDNN), e.g. on an
H200: ``PYTHONPATH=. python3 -m benchmarks.attention --paged-only --out $OUT/attention.json``.

Rows: ``xla`` (the reference), ``triton`` and, on a GPU, cuDNN
(``jax.nn.dot_product_attention(..., implementation="cudnn")`` on the dense
``[B, T, H, D]`` layout with ``query_seq_lengths`` / ``key_value_seq_lengths``; its causal
mask is top-left aligned, so it runs causal only where every sequence has as many queries
as keys and unmasked otherwise — for chunked prefill that adds the q_len² / 2 pairs above
the diagonal, 1-3 % of the work here). FLOPs count useful work only,
``4 · D · Hq · (visible query-key pairs)``; bytes count q, out and the K/V entries that
are visible to some query (each read once per KV head).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from pallas_kernels import masked_tail_attention
from pallas_kernels.attention import api as attention_api
from pallas_kernels.backend import backend_for, on_gpu


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    q_lens: tuple[int, ...]  # new tokens per sequence
    kv_lens: tuple[int, ...]  # keys per sequence, the new tokens included
    cache_len: int  # L
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    causal: bool = True

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def visible_pairs(self) -> int:
        """(query, key) pairs inside the mask (bottom-right causal: row i of a sequence
        with n queries and K keys sees K - n + i + 1 keys)."""
        total = 0
        for n, k in zip(self.q_lens, self.kv_lens, strict=True):
            total += n * (k - n) + n * (n + 1) // 2 if self.causal else n * k
        return total


def problems(quick: bool) -> list[Problem]:
    rng = np.random.default_rng(0)
    if quick:
        small = dict(num_q_heads=4, num_kv_heads=2, head_dim=16)
        return [
            Problem("tiny-dense", (32, 32), (32, 32), 32, **small),
            Problem("tiny-ragged", (8, 16, 4, 32), (8, 16, 4, 32), 32, **small),
            Problem("tiny-chunked", (16, 16), (48, 80), 96, **small),
            Problem("tiny-decode-4", (1,) * 4, (9, 30, 64, 3), 64, **small),
        ]
    ragged = (1024, 2048, 512, 4096)
    cached = rng.integers(8192, 32768 - 512, size=8, endpoint=True)
    out = [
        Problem("dense-causal", (4096,) * 4, (4096,) * 4, 4096),
        Problem("ragged-tail", ragged, ragged, 4096, num_kv_heads=32),
        Problem("chunked-prefill", (512,) * 8, tuple(int(c) + 512 for c in cached), 32768),
    ]
    for rows in (64, 256):
        kv = rng.integers(1024, 32768, size=rows, endpoint=True)
        out.append(Problem(f"decode-{rows}", (1,) * rows, tuple(int(k) for k in kv), 32768))
    return out


def cost(p: Problem) -> tuple[float, float]:
    """(FLOPs, bytes) of useful work: QKᵀ and PV over the visible pairs; q and out once,
    each needed key and value once per KV head (bf16)."""
    bf16 = 2
    flops = 4.0 * p.head_dim * p.num_q_heads * p.visible_pairs()
    needed_keys = sum(min(k, p.cache_len) for k in p.kv_lens)
    bytes_moved = (
        2 * p.num_tokens * p.num_q_heads * p.head_dim * bf16
        + 2 * needed_keys * p.num_kv_heads * p.head_dim * bf16
    )
    return flops, float(bytes_moved)


def dense_queries(p: Problem, q: jax.Array, qsl: np.ndarray) -> jax.Array:
    """Packed ``q[T, Hq, D]`` → zero-padded ``[B, max q_len, Hq, D]`` for cuDNN."""
    rows = [
        jnp.pad(q[qsl[b] : qsl[b + 1]], ((0, max(p.q_lens) - n), (0, 0), (0, 0)))
        for b, n in enumerate(p.q_lens)
    ]
    return jnp.stack(rows)


def page_pool(
    k_cache: jax.Array, v_cache: jax.Array, kv_lens: Sequence[int], page_size: int, seed: int = 0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The contiguous caches' used pages in a shuffled pool: ``(k_pool, v_pool, block_table)``.

    Slot ``b`` of ``k_cache[B, L, Hkv, D]`` holds sequence ``b``; its first
    ``cdiv(kv_lens[b], page_size)`` pages go to random places of a pool of exactly the
    pages in use (what a paged engine allocates); table entries past them are -1.
    """
    num_seqs, cache_len = k_cache.shape[:2]
    if cache_len % page_size:
        raise ValueError(f"--page-size={page_size} must divide the cache length {cache_len}")
    max_blocks = cache_len // page_size
    used = [
        (b, j) for b, n in enumerate(kv_lens) for j in range(-(-min(n, cache_len) // page_size))
    ]
    order = np.random.default_rng(seed).permutation(len(used))
    source = np.empty(len(used), np.int32)  # pool page -> page of the contiguous cache
    table = np.full((num_seqs, max_blocks), -1, np.int32)
    for page, i in enumerate(order):
        b, j = used[i]
        source[page] = b * max_blocks + j
        table[b, j] = page
    source = jnp.asarray(source)

    def pool(cache):
        return cache.reshape(num_seqs * max_blocks, page_size, *cache.shape[2:])[source]

    return pool(k_cache), pool(v_cache), jnp.asarray(table)


def bench(
    p: Problem, ceilings: harness.Ceilings, *, page_size: int, paged_only: bool = False
) -> list[dict]:
    B, T, L = len(p.q_lens), p.num_tokens, p.cache_len
    keys = iter(jax.random.split(jax.random.key(1), 3))

    def normal(*shape):  # drawn on the device: the decode caches are 16 GiB each
        return jax.random.normal(next(keys), shape, jnp.bfloat16)

    q = normal(T, p.num_q_heads, p.head_dim)
    # Slot b holds sequence b, so the caches double as cuDNN's dense [B, L, Hkv, D] keys.
    k_cache, v_cache = (normal(B, L, p.num_kv_heads, p.head_dim) for _ in range(2))
    qsl = np.concatenate([[0], np.cumsum(p.q_lens)]).astype(np.int32)
    kv_lens = jnp.asarray(p.kv_lens, jnp.int32)
    slots = jnp.arange(B, dtype=jnp.int32)
    flops, bytes_moved = cost(p)
    extra = dict(tokens=T, sequences=B, visible_pairs=p.visible_pairs())
    rows = []

    def add(impl, fn, *args, **row_extra):
        timing = harness.time_fn(lambda: fn(*args))
        rows.append(
            harness.row(
                p.name,
                impl,
                timing,
                flops=flops,
                bytes_moved=bytes_moved,
                ceilings=ceilings,
                op="masked_tail_attention",
                **extra,
                **row_extra,
            )
        )

    impls = [
        impl
        for impl in harness.runnable(attention_api.MASKED_TAIL_ATTENTION)
        if not (paged_only and impl == "xla")
    ]
    for impl in impls:
        call = functools.partial(
            masked_tail_attention,
            query_start_loc=qsl,
            kv_lens=kv_lens,
            slot_ids=slots,
            causal=p.causal,
            implementation=impl,
        )
        try:
            backend_for(call, q, k_cache, v_cache)
        except ValueError as error:  # e.g. the Mosaic GPU kernel on a decode batch
            print(f"note: {p.name}: no {impl} row ({error})")
            continue
        add(impl, jax.jit(call), q, k_cache, v_cache)

    pallas = [impl for impl in impls if impl != "xla"]
    if pallas:
        k_pool, v_pool, table = page_pool(k_cache, v_cache, p.kv_lens, page_size)
        contiguous = {r["implementation"]: r["median_ms"] for r in rows}
        for impl in pallas:
            call = functools.partial(
                masked_tail_attention,
                query_start_loc=qsl,
                kv_lens=kv_lens,
                slot_ids=slots,
                block_table=table,
                causal=p.causal,
                implementation=impl,
            )
            try:
                backend_for(call, q, k_pool, v_pool)
            except ValueError as error:
                print(f"note: {p.name}: no {impl}-paged row ({error})")
                continue
            add(f"{impl}-paged", jax.jit(call), q, k_pool, v_pool, page_size=page_size)
            if impl in contiguous:
                rows[-1]["paged_over_contiguous"] = rows[-1]["median_ms"] / contiguous[impl]
        del k_pool, v_pool  # the decode pools are GiBs
    if paged_only:
        return rows

    if not on_gpu():
        print(f"note: {p.name}: no cudnn row (needs a CUDA GPU)")
        return rows
    # Top-left causal equals ours only when every sequence has as many queries as keys.
    cudnn_causal = p.causal and p.q_lens == p.kv_lens
    fn = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=cudnn_causal,
            query_seq_lengths=jnp.asarray(p.q_lens, jnp.int32),
            key_value_seq_lengths=kv_lens,
            implementation="cudnn",
        )
    )
    q_dense = dense_queries(p, q, qsl)
    try:
        jax.block_until_ready(fn(q_dense, k_cache, v_cache))
    except (NotImplementedError, ValueError, RuntimeError) as error:
        print(f"note: {p.name}: no cudnn row ({type(error).__name__}: {error})")
        return rows
    add("cudnn", fn, q_dense, k_cache, v_cache, cudnn_causal=cudnn_causal)
    return rows


def _paged_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """This module's own flags (``--paged-only``, ``--page-size``) and the rest of argv."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--paged-only", action="store_true")
    parser.add_argument("--page-size", type=int, default=None)
    return parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))


def report_paged(rows: Sequence[dict]) -> None:
    """Prints each paged row next to its contiguous row."""
    paged = [r for r in rows if "paged_over_contiguous" in r]
    if not paged:
        return
    header = f"{'problem':<22}{'impl':<8}{'contig ms':>10}{'paged ms':>10}{'paged/contig':>14}"
    print("\n## paged KV (block_table) vs contiguous slots\n" + header + "\n" + "-" * len(header))
    for r in paged:
        impl = r["implementation"].removesuffix("-paged")
        print(
            f"{r['problem']:<22}{impl:<8}{r['median_ms'] / r['paged_over_contiguous']:>10.3f}"
            f"{r['median_ms']:>10.3f}{r['paged_over_contiguous']:>14.3f}"
        )


def main(argv: Sequence[str] | None = None) -> list[dict]:
    command = list(sys.argv[1:] if argv is None else argv)
    paged, argv = _paged_args(command)
    args = harness.parse_args(
        argv, "masked_tail_attention benchmarks", module="attention", command=command
    )
    page_size = paged.page_size or (16 if args.quick else 256)
    ceilings = harness.measure_ceilings(quick=args.quick)
    rows = []
    for p in problems(args.quick):
        if harness.selected(p.name, args.only):
            rows += bench(p, ceilings, page_size=page_size, paged_only=paged.paged_only)
            # Progressively: a run cut short keeps what it measured.
            harness.write_report(rows, ceilings, args.output)
    harness.add_speedups(rows)
    harness.report("masked_tail_attention", rows, ceilings, args.output)
    report_paged(rows)
    return rows


if __name__ == "__main__":
    main()
