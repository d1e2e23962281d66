"""Training benchmarks: kernels forward + backward, and a train step of a 1.3B hybrid.

``python -m benchmarks.train [--out FILE] [--results-dir DIR] [--quick]
[--only ssd,attention,train]``;
sections (``--only`` takes names separated by commas or spaces; default all):

* ``ssd``: ``ssd_scan`` forward + backward (``jax.vjp`` with a random bf16 cotangent of y:
  gradients of x, dt, A, B, C, D and dt_bias) on mamba-ssm's training problem, 8 × 4096
  tokens (eight sequences packed), H 128, P 64, N 128, bf16, ``dt_softplus``: G 1 with
  chunks of 256 and G 8 with chunks of 128. Rows ``auto``, each other Pallas backend that
  serves the call, ``xla``, and on a GPU the optional peer jax-linear-attention 0.1.0
  (``pip install .[benchmarks]``; its Mosaic GPU ``simple_gla`` with the same dt and D
  glue, :func:`_jla_ssd`) where it is installed.
* ``attention``: ``masked_tail_attention`` causal prefill forward + backward (gradients of
  q, k_cache and v_cache), Hq 32, Hkv 8, D 128 (``benchmarks/attention.py``'s main problem),
  bf16, on 4 × 4096 (the shape of the cuDNN figure in shared/ANCHORS.md) and 8 × 4096
  tokens; rows ``auto``, the other Pallas backends, ``xla`` and cuDNN
  (``jax.nn.dot_product_attention(implementation="cudnn")`` on the dense ``[B, L, H, D]``
  layout, causal; a note instead of a row where cuDNN cannot run).
* ``train``: one optimizer step (forward, backward, AdamW update; ``flax_models.training``)
  of a 1.3B-parameter Bamba-style model (:func:`bamba_1b`), 8 × 4096 tokens, bf16
  parameters and compute (AdamW's state fp32), ``remat="block"`` (``--remat``); ``auto`` and
  ``xla`` on the same initial weights. Rows carry tokens/s and the model FLOPs
  utilisation against both the bf16 matmul rate measured in this run and the H200's
  nominal dense bf16 peak (:data:`NOMINAL_BF16_TFLOPS`), the first step's time (compile
  included) and the process's peak device memory so far (``--only train`` for the step's
  own).

* ``lora``: a LoRA fine-tuning step of the Bamba-9B shape (:func:`bench_lora`): rank-16
  adapters on every projection, the bf16 base frozen, 8 × 4096 tokens.

FLOPs count the model's own work, not recomputation: forward + backward is 3 × the forward
work for the SSD scan (``benchmarks/ssd.py``'s count; the backward does about twice the
forward's products) and 3.5 × for attention (FlashAttention-2's count: QKᵀ and PV forward, five
products backward). A train step counts ``6 · N · tokens`` (N: the parameters that multiply
activations, i.e. all but the input embedding table, a gather) plus the attention layers'
``12 · D · Hq · (causal pairs)``; the SSD scan's own sequence mixing is reported beside it
(``ssd_flops``) but, as usual for MFU, not counted. The JSON is rewritten after every row,
so a run cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import harness
from benchmarks import ssd as ssd_benchmark
from flax_models.config import HybridConfig
from flax_models.lora import add_lora
from flax_models.model import HybridLM
from flax_models.training import make_optimizer, train_step
from pallas_kernels import masked_tail_attention, ssd_scan
from pallas_kernels.attention import api as attention_api
from pallas_kernels.backend import backend_for, on_gpu
from pallas_kernels.ssd import api as ssd_api
from pallas_kernels.ssd import mosaic as ssd_mosaic
from pallas_kernels.ssd import mosaic_config as ssd_mosaic_config
from pallas_kernels.ssd import mosaic_vjp as ssd_mosaic_vjp
from pallas_kernels.ssd import triton as ssd_triton
from pallas_kernels.ssd import triton_config as ssd_triton_config
from pallas_kernels.ssd import triton_vjp as ssd_triton_vjp

SECTIONS: Final = ("ssd", "attention", "train", "lora")
# NVIDIA H200 SXM datasheet: 989 TFLOP/s dense bf16 tensor-core peak (1979 with sparsity).
NOMINAL_BF16_TFLOPS: Final = 989.0
# The optional peer's row name (PyPI jax-linear-attention, pinned to this project's jax).
JLA: Final = "jax-linear-attention"
TITLE: Final = "training: kernels forward + backward, train step"
# --remat: the train step's HybridLM(remat=). "dots" keeps the matmul outputs (about 1.4 GB
# a layer here) and recomputes the rest; "none" keeps every activation.
REMAT: Final = {
    "block": "block",
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "none": None,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_output_arguments(parser)  # the JSON, rewritten after every row
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="SECTION",
        help=f"sections to run, of {', '.join(SECTIONS)} (commas or spaces)",
    )
    parser.add_argument(
        "--remat",
        choices=sorted(REMAT),
        default="block",
        help="the train step's rematerialisation (HybridLM(remat=)); default block",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.output = harness.output_for(args, "train", argv)
    if args.only is not None:
        args.only = [name for item in args.only for name in item.split(",") if name]
        unknown = sorted(set(args.only) - set(SECTIONS))
        if unknown or not args.only:
            parser.error(f"--only: expected sections of {SECTIONS}, got {args.only}")
    return args


@dataclasses.dataclass
class Results:
    """The rows so far; every :meth:`add` rewrites the JSON (``harness.report``'s format)."""

    ceilings: harness.Ceilings
    output: harness.Output
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        harness.add_speedups(self.rows)
        extra = f", {row['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in row else ""
        print(f"{row['problem']} {row['implementation']}: {row['median_ms']:.3f} ms{extra}")
        harness.write_report(self.rows, self.ceilings, self.output)  # the table: at the end


def _kernel_implementations(op: Any, call: Callable[[str], Any]) -> list[str]:
    """``auto``, then every other non-xla backend this machine runs that serves the call
    (not the one ``auto`` picks: that row would be a copy), then ``xla``."""
    auto = backend_for(call, implementation="auto")
    others = [
        name for name in harness.runnable(op) if name not in ("xla", auto) and _serves(call, name)
    ]
    return ["auto", *others, "xla"]


def _serves(call: Callable[..., Any], name: str) -> bool:
    try:
        backend_for(call, implementation=name)
    except ValueError as error:
        print(f"note: no {name} row ({error})")
        return False
    return True


def _time_or_note(label: str, fn: Callable[[], Any], **kwargs: Any) -> harness.Timing | None:
    """Times ``fn`` like every benchmark does; a failure (no backward pass yet, out of
    memory, cuDNN refusing the shapes) is printed and gives None, so the run goes on."""
    try:
        return harness.time_fn(fn, **kwargs)
    except Exception as error:  # noqa: BLE001 — any failure of one row is reported, not fatal
        reason = harness.failure_reason(error)
        print(f"note: no {label} row ({type(error).__name__}: {reason})", flush=True)
        return None


# ------------------------------------------------------------------------------ ssd_scan


def ssd_problems(quick: bool) -> list[ssd_benchmark.PrefillProblem]:
    if quick:
        small = dict(heads=4, head_dim=8, state_dim=8, chunk_size=16)
        return [
            ssd_benchmark.PrefillProblem("ssd-tiny-g1", (64, 40), **small),
            ssd_benchmark.PrefillProblem("ssd-tiny-g2", (64, 40), groups=2, **small),
        ]
    uniform = (4096,) * 8
    return [
        ssd_benchmark.PrefillProblem("ssd-g1-chunk256", uniform),
        ssd_benchmark.PrefillProblem("ssd-g8-chunk128", uniform, groups=8, chunk_size=128),
    ]


def bench_ssd(p: ssd_benchmark.PrefillProblem, results: Results) -> None:
    inputs = ssd_benchmark.prefill_inputs(p)
    md = inputs["metadata"]
    n = int(md.num_chunks)
    flops, bytes_moved = ssd_benchmark.prefill_cost(p, np.asarray(md.cu_chunk_seqlens)[: n + 1])
    # The backward reads the inputs and dy and writes a gradient per input: about the
    # forward's traffic again.
    flops, bytes_moved = 3 * flops, 2 * bytes_moved
    float_args = {k: inputs[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")}
    dy = jax.random.normal(jax.random.key(3), inputs["x"].shape, jnp.bfloat16)
    args = tuple(float_args.values())

    def scan(implementation, x, dt, A, B, C, D, dt_bias):
        y, _ = ssd_scan(
            x,
            dt,
            A,
            B,
            C,
            metadata=md,
            chunk_size=p.chunk_size,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=True,
            implementation=implementation,
        )
        return y

    def call(implementation):
        return scan(implementation, *args)

    for impl in _kernel_implementations(ssd_api.SSD_SCAN, call):
        forward = functools.partial(scan, impl)
        fwd_bwd = jax.jit(lambda args, dy, f=forward: jax.vjp(f, *args)[1](dy))
        timing = _time_or_note(f"{p.name} {impl}", lambda f=fwd_bwd: f(args, dy))
        if timing is None:
            continue
        backend = backend_for(call, implementation=impl)
        stages = {}
        # The launches of each backend's own row (auto's is its backend's).
        if on_gpu() and impl in ("auto", backend) and backend in ("mosaic", "triton"):
            stages = dict(stages_ms=ssd_stage_times(p, inputs, dy, backend))
            print(f"{p.name} {impl} launches (ms): {stages['stages_ms']}")
        results.add(
            harness.row(
                p.name,
                impl,
                timing,
                flops=flops,
                bytes_moved=bytes_moved,
                ceilings=results.ceilings,
                op="ssd_scan forward + backward",
                backend=backend,
                tokens=sum(p.lengths),
                groups=p.groups,
                chunk_size=p.chunk_size,
                **stages,
            )
        )
    peer = _jla_ssd(p, md)
    if peer is None:
        return
    fwd_bwd = jax.jit(lambda args, dy: jax.vjp(peer, *args)[1](dy))
    timing = _time_or_note(f"{p.name} {JLA}", lambda: fwd_bwd(args, dy))
    if timing is not None:
        results.add(
            harness.row(
                p.name,
                JLA,
                timing,
                flops=flops,
                bytes_moved=bytes_moved,
                ceilings=results.ceilings,
                op="ssd_scan forward + backward",
                backend="mosaic_gpu (jax-linear-attention)",
                tokens=sum(p.lengths),
                groups=p.groups,
                chunk_size=p.chunk_size,
            )
        )


def ssd_stage_times(
    p: ssd_benchmark.PrefillProblem, inputs: dict, dy: jax.Array, backend: str
) -> dict[str, float]:
    """The per-launch profile of ``bench_ssd``'s forward + backward on ``backend``
    (``"mosaic"`` or ``"triton"``): the median ms of each launch run alone, in order, on
    what the launches before it wrote (the forward's residuals, then the backward's). The
    row's total less their sum is XLA's glue between them (the dt chain rule, the reverse
    cumsum of the decay cotangent, the head and split sums of dB and dC)."""
    x, dt, A, B, C, D, dt_bias = (inputs[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias"))
    md = inputs["metadata"]
    cu = md.cu_chunk_seqlens
    s = ssd_triton_config.ScanShapes.of(x, B, md)
    f32 = jnp.float32
    blocks = ssd_triton_config.default_block_sizes(p.chunk_size, p.head_dim, p.state_dim)
    backward_blocks = ssd_triton_config.default_backward_block_sizes(blocks, x.dtype)
    D_hp = jnp.broadcast_to(D.astype(f32).reshape(s.heads, -1), (s.heads, s.head_dim))
    scan_options = dict(
        dt_softplus=True,
        dt_limit=(0.0, math.inf),
        intermediate=False,
        state_dtype=f32,
        blocks=blocks,
        interpret=False,
    )
    times: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., Any], *operands: Any) -> Any:
        compiled = jax.jit(fn)
        times[name] = harness.time_fn(lambda: compiled(*operands)).median_ms
        return compiled(*operands)

    if backend == "mosaic":
        mosaic_states = ssd_mosaic.state_scan_supports(
            heads_per_group=s.heads // s.groups, state_dim=s.state_dim, intermediate=False
        )
        config = ssd_mosaic_config.BlockSizes()
        state_fn, chunk_scan_fn = ssd_mosaic.residual_stages(config, mosaic_states)
        carried_dtype = C.dtype
    else:
        state_fn, carried_dtype = ssd_triton.state_scan, f32

    dt_chunks, cum, carried, _ = timed(
        "state_scan",
        lambda x, dt, A, B, dt_bias: state_fn(
            s, md, x, dt, A, B, dt_bias, None, carried_dtype=carried_dtype, **scan_options
        ),
        x,
        dt,
        A,
        B,
        dt_bias,
    )
    # The Mosaic backward (where it fits) forms C·Bᵀ and y_ssm itself: the forward saves
    # neither, and the rows' own terms are a second chunk scan in the backward.
    mosaic_backward = backend == "mosaic" and ssd_mosaic_config.backward_supports(
        chunk_size=s.chunk_size,
        state_dim=s.state_dim,
        num_stages=config.num_stages,
        itemsize=x.dtype.itemsize,
    )
    if mosaic_backward:
        timed(
            "chunk_scan",
            lambda *a: chunk_scan_fn(s, md, *a, None),
            x,
            C,
            B,
            dt_chunks,
            cum,
            carried,
            D_hp,
        )
        residuals = ssd_triton_config.Residuals(dt_chunks, cum, carried, None, None)
    else:  # the Triton chunk scan writes y and y_ssm in one launch (with C·Bᵀ, timed apart)
        cb = timed(
            "chunk_cb",
            lambda C, B: ssd_triton.chunk_cb(s, cu, C, B, blocks=blocks, interpret=False),
            C,
            B,
        )
        y_ssm = timed(
            "chunk_scan",
            lambda *a: ssd_triton.chunk_scan(
                s, cu, *a, None, blocks=blocks, interpret=False, with_ssm=True
            )[1],
            x,
            C,
            cb,
            dt_chunks,
            cum,
            carried,
            D_hp,
        )
        residuals = ssd_triton_config.Residuals(dt_chunks, cum, carried, cb, y_ssm)
    dstates = jnp.zeros((s.num_seqs, s.heads, s.head_dim, s.state_dim), f32)
    stage = dict(blocks=backward_blocks, interpret=False)
    _, ds_out, *_ = timed(
        "bwd_state_pass",
        lambda dy, C, res, dstates: ssd_triton_vjp.state_pass(
            s, md, dy, None, C, res, dstates, intermediate=False, **stage
        ),
        dy,
        C,
        residuals,
        dstates,
    )
    mosaic_dbc = backend == "mosaic" and ssd_mosaic_config.chunk_dbc_supports(
        chunk_size=s.chunk_size,
        state_dim=s.state_dim,
        num_stages=config.num_stages,
        itemsize=x.dtype.itemsize,
    )

    def chunk_dx(x, B, C, res, ds_out, D, dy):
        if mosaic_backward:
            return ssd_mosaic_vjp.chunk_dx(s, md, x, B, C, res, ds_out, D, dy, config=config)
        return ssd_triton_vjp.chunk_dx(s, cu, x, B, res, ds_out, D, None, dy, dy, **stage)

    def chunk_dbc(x, B, C, res, ds_out, dy):
        if mosaic_dbc:
            return ssd_mosaic_vjp.chunk_dbc(s, md, x, B, C, res, ds_out, dy, config=config)
        return ssd_triton_vjp.chunk_dbc(s, cu, x, B, C, res, ds_out, dy, **stage)

    timed("bwd_chunk_dx", chunk_dx, x, B, C, residuals, ds_out, D_hp, dy)
    if mosaic_backward:
        timed(
            "bwd_rows",
            lambda x, B, C, res, D, dy: ssd_mosaic.row_terms(
                s, md, x, B, C, res, D, None, dy, config=config
            ),
            x,
            B,
            C,
            residuals,
            D_hp,
            dy,
        )
    timed("bwd_chunk_dbc", chunk_dbc, x, B, C, residuals, ds_out, dy)
    return times


def _jla_ssd(p: ssd_benchmark.PrefillProblem, md) -> Callable[..., jax.Array] | None:
    """The same scan through jax-linear-attention's Mosaic GPU ``simple_gla`` (the optional
    peer; the ``benchmarks`` extra), or None where it is not installed or not on a GPU:
    ``q = C``, ``k = B``, ``v = dt' x``, ``g = dt' A`` per token and head on the dense
    ``[sequences, L, heads, dim]`` layout (every sequence of the problem is one length),
    ``scale = 1``, with dt' = softplus(dt + dt_bias) and the D skip in ``jnp`` as the
    project's scan computes them; ``jax.vjp`` differentiates all of it."""
    try:
        from jla.ops import linear_attention
    except ImportError:
        print(f"note: {p.name}: no {JLA} row (jax-linear-attention is not installed)")
        return None
    if not on_gpu() or len(set(p.lengths)) != 1:
        print(f"note: {p.name}: no {JLA} row (needs a GPU and sequences of one length)")
        return None
    S, L = len(p.lengths), p.lengths[0]

    def scan(x, dt, A, B, C, D, dt_bias):
        dt_p = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias)  # [T, H]
        v = (x.astype(jnp.float32) * dt_p[..., None]).astype(x.dtype)
        y, _ = linear_attention(
            "simple_gla",
            C.reshape(S, L, *C.shape[1:]),
            B.reshape(S, L, *B.shape[1:]),
            v.reshape(S, L, *v.shape[1:]),
            g=(dt_p * A).reshape(S, L, -1),
            scale=1.0,
            impl="mosaic_gpu",  # its own chunks of 64: the only size its kernels take
        )
        y = y.reshape(x.shape).astype(jnp.float32) + D[:, None] * x.astype(jnp.float32)
        return y.astype(x.dtype)

    return scan


# ------------------------------------------------------------------- masked_tail_attention


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    name: str
    num_seqs: int
    seq_len: int
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128

    @property
    def pairs(self) -> int:
        """Causal (query, key) pairs."""
        return self.num_seqs * self.seq_len * (self.seq_len + 1) // 2


def attention_problems(quick: bool) -> list[AttentionProblem]:
    if quick:
        return [AttentionProblem("attention-tiny", 2, 32, 4, 2, 16)]
    return [
        AttentionProblem("attention-4x4096", 4, 4096),
        AttentionProblem("attention-8x4096", 8, 4096),
    ]


def bench_attention(p: AttentionProblem, results: Results) -> None:
    B, L, Hq, Hkv, D = p.num_seqs, p.seq_len, p.num_q_heads, p.num_kv_heads, p.head_dim
    keys = iter(jax.random.split(jax.random.key(4), 4))

    def normal(*shape):
        return jax.random.normal(next(keys), shape, jnp.bfloat16)

    q, do = normal(B * L, Hq, D), normal(B * L, Hq, D)
    # Slot b holds sequence b, so the caches are also cuDNN's dense [B, L, Hkv, D] keys.
    k_cache, v_cache = normal(B, L, Hkv, D), normal(B, L, Hkv, D)
    qsl = jnp.arange(B + 1, dtype=jnp.int32) * L
    kv_lens = jnp.full((B,), L, jnp.int32)
    slots = jnp.arange(B, dtype=jnp.int32)
    bf16 = 2
    # Forward 4 D Hq pairs; backward 2.5 × that (FlashAttention-2's count).
    flops = 3.5 * 4.0 * D * Hq * p.pairs
    # Forward: q, k, v read, out written; backward: q, k, v, out, dout read, dq, dk, dv
    # written.
    qo, kv = B * L * Hq * D * bf16, B * L * Hkv * D * bf16
    bytes_moved = float((2 * qo + 2 * kv) + (4 * qo + 4 * kv))
    extra = dict(op="masked_tail_attention forward + backward", tokens=B * L, pairs=p.pairs)

    def attend(implementation, q, k, v):
        return masked_tail_attention(
            q,
            k,
            v,
            query_start_loc=qsl,
            kv_lens=kv_lens,
            slot_ids=slots,
            causal=True,
            implementation=implementation,
        )

    def call(implementation):
        return attend(implementation, q, k_cache, v_cache)

    def add(impl, forward, *args, **row_extra):
        fwd_bwd = jax.jit(lambda args, do: jax.vjp(forward, *args)[1](do))
        timing = _time_or_note(f"{p.name} {impl}", lambda: fwd_bwd(args, do_for(impl)))
        if timing is not None:
            results.add(
                harness.row(
                    p.name,
                    impl,
                    timing,
                    flops=flops,
                    bytes_moved=bytes_moved,
                    ceilings=results.ceilings,
                    **extra,
                    **row_extra,
                )
            )

    def do_for(impl):
        return do.reshape(B, L, Hq, D) if impl == "cudnn" else do

    for impl in _kernel_implementations(attention_api.MASKED_TAIL_ATTENTION, call):
        backend = backend_for(call, implementation=impl)
        add(impl, functools.partial(attend, impl), q, k_cache, v_cache, backend=backend)
    if not on_gpu():
        print(f"note: {p.name}: no cudnn row (needs a CUDA GPU)")
        return

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    add("cudnn", cudnn, q.reshape(B, L, Hq, D), k_cache, v_cache)


# ---------------------------------------------------------------------------- train step


def bamba_1b(**overrides: Any) -> HybridConfig:
    """A 1.3B-parameter Bamba-style hybrid: hidden 2048, 24 layers (attention at 6, 12 and
    18, Mamba2 elsewhere, each followed by a SwiGLU MLP of 4096), Mamba2 with Bamba-9B's
    heads of 64 and state of 128 (64 heads, one group, chunks of 256), attention with 16
    query and 4 KV heads of 128, a 32k vocabulary."""
    fields = dict(
        family="bamba",
        vocab_size=32768,
        hidden_size=2048,
        layer_pattern="".join("*" if i in (6, 12, 18) else "M" for i in range(24)),
        mlp_per_layer=True,
        mamba_num_heads=64,
        mamba_head_dim=64,
        mamba_state_size=128,
        mamba_groups=1,
        mamba_chunk_size=256,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
        partial_rotary_factor=0.5,
        intermediate_size=4096,
    )
    return HybridConfig(**(fields | overrides))


def train_flops(cfg: HybridConfig, model: HybridLM, batch: int, length: int) -> dict[str, float]:
    """Model FLOPs of one train step (forward + backward) on ``batch`` fresh sequences of
    ``length`` tokens: ``6 N T`` over the matmul parameters, ``12 D Hq pairs`` per
    attention layer, and the SSD scan's ``3 ×`` forward chunk work (reported, not in the
    total)."""
    params = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    matmul_params = params - cfg.vocab_size * cfg.hidden_size  # the input table is a gather
    if model.lm_head is None:  # tied: the table is also the head, a matmul
        matmul_params += cfg.vocab_size * cfg.hidden_size
    tokens = batch * length
    pairs = batch * length * (length + 1) / 2
    attention = 12.0 * cfg.head_dim * cfg.num_heads * pairs * cfg.layer_pattern.count("*")
    chunk_lens = np.full(batch * (length // cfg.mamba_chunk_size), cfg.mamba_chunk_size)
    if length % cfg.mamba_chunk_size:
        chunk_lens = np.concatenate([chunk_lens, [length % cfg.mamba_chunk_size] * batch])
    ssd_problem = ssd_benchmark.PrefillProblem(
        "train",
        (length,) * batch,
        heads=cfg.mamba_num_heads,
        head_dim=cfg.mamba_head_dim,
        state_dim=cfg.mamba_state_size,
        groups=cfg.mamba_groups,
        chunk_size=cfg.mamba_chunk_size,
    )
    ssd_forward, _ = ssd_benchmark.prefill_cost(
        ssd_problem, np.concatenate([[0], chunk_lens.cumsum()])
    )
    return dict(
        params=float(params),
        matmul_params=float(matmul_params),
        flops=6.0 * matmul_params * tokens + attention,
        attention_flops=attention,
        ssd_flops=3.0 * ssd_forward * cfg.layer_pattern.count("M"),
    )


def bench_train(args: argparse.Namespace, results: Results) -> None:
    if args.quick:
        cfg, dtype, (batch, length) = HybridConfig.tiny(), jnp.float32, (2, 64)
        name, samples = "train-tiny", dict(auto=3, xla=3)
    else:
        cfg, dtype, (batch, length) = bamba_1b(), jnp.bfloat16, (8, 4096)
        # The xla step takes seconds: fewer samples keep the run within its budget.
        name, samples = "train-bamba-1.3b", dict(auto=4, xla=2)
    ids = jax.random.randint(jax.random.key(5), (batch, length), 0, cfg.vocab_size, jnp.int32)
    for impl in ("auto", "xla"):  # auto first, on a device nothing else has fragmented
        model = HybridLM(
            cfg, dtype=dtype, implementation=impl, remat=REMAT[args.remat], rngs=nnx.Rngs(0)
        )  # the same draws: the same initial weights for both rows
        optimizer = make_optimizer(model)
        cost = train_flops(cfg, model, batch, length)
        start = time.perf_counter()
        try:  # compile and one step
            jax.block_until_ready(train_step(model, optimizer, ids))
        except Exception as error:  # noqa: BLE001 — reported, the other row still runs
            reason = harness.failure_reason(error)
            print(f"note: no {name} {impl} row ({type(error).__name__}: {reason})", flush=True)
            del model, optimizer
            gc.collect()
            continue
        first_step_s = time.perf_counter() - start
        # One step per sample (each takes far longer than the 1 ms floor).
        timing = _time_or_note(
            f"{name} {impl}",
            lambda m=model, o=optimizer: train_step(m, o, ids),
            warmup=1,
            samples=samples[impl],
            min_sample_ms=0.0,
        )
        if timing is not None:
            results.add(
                _step_row(
                    name,
                    impl,
                    timing,
                    results,
                    flops=cost["flops"],
                    op="train step (forward, backward, AdamW)",
                    tokens=batch * length,
                    first_step_s=first_step_s,
                    remat=args.remat,
                    dtype=jnp.dtype(dtype).name,
                    **{k: v for k, v in cost.items() if k != "flops"},
                )
            )
        del model, optimizer
        gc.collect()


def _step_row(
    name: str,
    impl: str,
    timing: harness.Timing,
    results: Results,
    *,
    flops: float,
    tokens: int,
    **extra: Any,
) -> dict[str, Any]:
    """A train step's row: compute-bound (its floor is the FLOPs'), with tokens/s, the
    model FLOPs utilisation against the measured and the nominal bf16 rate, and the peak
    memory so far."""
    seconds = timing.median_ms * 1e-3
    achieved = flops / seconds / 1e12
    return harness.row(
        name,
        impl,
        timing,
        flops=flops,
        bytes_moved=0.0,
        ceilings=results.ceilings,
        tokens=tokens,
        tokens_per_s=tokens / seconds,
        mfu_measured=achieved / results.ceilings.matmul_tflops,
        mfu_nominal=achieved / NOMINAL_BF16_TFLOPS,
        nominal_tflops=NOMINAL_BF16_TFLOPS,
        peak_bytes=harness.peak_bytes(),
        **extra,
    )


def bench_lora(args: argparse.Namespace, results: Results) -> None:
    """A LoRA fine-tuning step of the Bamba-9B shape: bf16 base weights, frozen; rank-16
    fp32 adapters on every Mamba, attention and MLP projection, trained alone (AdamW over
    the ``nnx.LoRAParam`` only); 8 × 4096 tokens, ``remat="block"``. FLOPs: what the step
    does, ``4 N T`` (forward and the activations' gradients; the frozen weights get none)
    plus the adapters' ``6 N_lora T`` and the attention layers' full ``12 D Hq pairs``."""
    if args.quick:
        cfg, dtype, (batch, length) = HybridConfig.tiny(), jnp.float32, (2, 64)
        name = "lora-tiny"
    else:
        cfg, dtype, (batch, length) = HybridConfig.bamba_9b(), jnp.bfloat16, (8, 4096)
        name = "lora-bamba-9b"
    rank = 16
    ids = jax.random.randint(jax.random.key(6), (batch, length), 0, cfg.vocab_size, jnp.int32)
    model = HybridLM(
        cfg, dtype=dtype, implementation="auto", remat=REMAT[args.remat], rngs=nnx.Rngs(0)
    )
    cost = train_flops(cfg, model, batch, length)
    add_lora(model, rank=rank, alpha=2.0 * rank, rngs=nnx.Rngs(1))
    optimizer = make_optimizer(model, trainable=nnx.LoRAParam)
    lora_params = sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    tokens = batch * length
    dense = cost["flops"] - cost["attention_flops"]  # 6 N T
    flops = 4.0 / 6.0 * dense + 6.0 * lora_params * tokens + cost["attention_flops"]
    start = time.perf_counter()
    try:
        jax.block_until_ready(train_step(model, optimizer, ids))
    except Exception as error:  # noqa: BLE001 — reported, the run goes on
        reason = harness.failure_reason(error)
        print(f"note: no {name} row ({type(error).__name__}: {reason})", flush=True)
        return
    first_step_s = time.perf_counter() - start
    timing = _time_or_note(
        name,
        lambda m=model, o=optimizer: train_step(m, o, ids),
        warmup=1,
        samples=4,
        min_sample_ms=0.0,
    )
    if timing is None:
        return
    results.add(
        _step_row(
            name,
            "auto",
            timing,
            results,
            flops=flops,
            op="LoRA train step (forward, backward, AdamW on the adapters)",
            tokens=tokens,
            first_step_s=first_step_s,
            remat=args.remat,
            dtype=jnp.dtype(dtype).name,
            lora_rank=rank,
            lora_params=float(lora_params),
            params=cost["params"],
            matmul_params=cost["matmul_params"],
            attention_flops=cost["attention_flops"],
        )
    )
    del model, optimizer
    gc.collect()


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    sections = args.only or list(SECTIONS)
    results = Results(harness.measure_ceilings(quick=args.quick), args.output)
    if "ssd" in sections:
        for p in ssd_problems(args.quick):
            bench_ssd(p, results)
    if "attention" in sections:
        for p in attention_problems(args.quick):
            bench_attention(p, results)
    if "train" in sections:
        bench_train(args, results)
    if "lora" in sections:
        bench_lora(args, results)
    harness.add_speedups(results.rows)
    harness.report(TITLE, results.rows, results.ceilings, args.output)
    for r in results.rows:
        if "tokens_per_s" in r:
            print(
                f"{r['problem']} {r['implementation']}: {r['tokens_per_s']:,.0f} tokens/s, "
                f"MFU {r['mfu_measured']:.1%} of the measured "
                f"{results.ceilings.matmul_tflops:.0f} TFLOP/s, {r['mfu_nominal']:.1%} of "
                f"the nominal {NOMINAL_BF16_TFLOPS:.0f}; {r['params'] / 1e9:.2f}B parameters"
            )
    return results.rows


if __name__ == "__main__":
    main()
