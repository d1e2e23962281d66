"""How close the decode state update comes to what an in-place update can reach (GPU).

``python tools/state_update_floor.py [--rows 64 256] [--out floor.json] [--quick]``: on
the Bamba-9B state shape (H 128, P 64, N 128, G 1, fp32 states in a slot-indexed cache of
2 R slots), times in one run, each as a fraction of the in-run copy rate:

- ``copy-back``: a kernel on the state update's grid and tiling that reads each named state
  tile and writes it back in place (scaled, so nothing can be elided): the floor of any
  in-place update with that access pattern;
- ``advance``: that plus the recurrence ``exp(dt' A) s + dt' x ⊗ B`` (dt, x and B loaded
  per head), without ``y = C · s``;
- ``state update`` and ``state update, z``: ``pk.selective_state_update`` itself on the
  Triton kernel with its default tiling, without and with the z gate.

The bytes of a row are the states read and written (plus, for the op, its inputs and y). On
the H200 (2026-11-27): copy-back 93-94.5%, advance 91-92%, the op 88% (z 87%): what the op
loses beyond the floor is mostly the reduction for y. With the row slowest in the launch
(2026-11-29, 64 rows): copy-back 95.6%, advance 95.2%, the op 90.8% (z 87.6%, on the gated
tiling before its heads were unrolled). ``--quick`` runs tiny shapes in interpret mode (a CPU
check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import pallas_kernels as pk
from benchmarks import harness
from benchmarks.ssd import DecodeProblem, decode_inputs
from pallas_kernels._common import decay_factor, process_dt
from pallas_kernels._pallas import compiler_params
from pallas_kernels.state_update import triton as state_update_triton
from pallas_kernels.testing import relative_error


def in_place_pass(
    cache: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    *,
    slot_ids: jax.Array,
    advance: bool,
    config: state_update_triton.BlockSizes,
    interpret: bool,
) -> jax.Array:
    """One pass over the named states of ``cache[S, H, P, N]`` in place, on the state
    update's grid (row, block of heads, head-dim block) and loop over heads (unrolled where
    the tiling says so): each tile scaled by 0.999 (``advance=False``) or advanced one token
    (G = 1). Rows need real slots (no padding), and the tiling must divide H and P."""
    rows = slot_ids.shape[0]
    H, P, N = cache.shape[1:]
    bh, bp = config.block_h, config.block_p

    def kernel(slot_ref, x_ref, dt_ref, A_ref, B_ref, cache_in_ref, cache_ref):
        del cache_in_ref  # aliased to cache_ref
        r, hb, pb = state_update_triton.program_indices()  # as the kernel
        slot, p0 = slot_ref[r], pb * bp

        def head(i, carry):
            h = hb * bh + i
            tile = cache_ref.at[slot, h, pl.ds(p0, bp), pl.ds(0, N)]
            state = plgpu.load(tile, eviction_policy="evict_last")
            if advance:
                dt_h = process_dt(
                    dt_ref[r, h].astype(jnp.float32), None, dt_softplus=True,
                    dt_limit=(0.0, float("inf")),
                )  # fmt: skip
                x_h = x_ref[r, h, pl.ds(p0, bp)].astype(jnp.float32)
                B_r = B_ref[r, 0, pl.ds(0, N)].astype(jnp.float32)
                state = decay_factor(dt_h * A_ref[h]) * state + (dt_h * x_h)[:, None] * B_r
            else:
                state = state * 0.999
            plgpu.store(tile, state)
            return carry

        state_update_triton.for_each_head(bh, config.unroll_heads, head)  # as the kernel

    return pl.pallas_call(
        kernel,
        grid=state_update_triton.launch_grid(rows, H, P, config),
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        input_output_aliases={5: 0},
        compiler_params=compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="state_update_floor_" + ("advance" if advance else "copy_back"),
    )(slot_ids, x, dt, A, B, cache)


def measure(rows: int, ceilings: harness.Ceilings, *, quick: bool) -> list[dict]:
    size = dict(heads=4, head_dim=8, state_dim=16) if quick else {}
    problem = DecodeProblem(f"decode-{rows}", rows, **size)
    inputs, make_cache = decode_inputs(problem)
    H, P, N = problem.heads, problem.head_dim, problem.state_dim
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    slots, z = inputs["slot_ids"], inputs["x"] * 0.5
    config = state_update_triton.default_block_sizes(P, N, rows=rows, num_heads=H)
    state_bytes = 2 * rows * H * P * N * 4
    op_bytes = state_bytes + rows * (2 * H * P + 2 * N + H) * 2
    implementation = "triton"

    def op(cache, gate):
        return pk.selective_state_update(
            cache, x, dt, A, B, C, slot_ids=slots, D=inputs["D"], z=gate,
            dt_bias=inputs["dt_bias"], dt_softplus=True, implementation=implementation,
        )  # fmt: skip

    def floor(cache, advance):
        return None, in_place_pass(
            cache, x, dt, A, B, slot_ids=slots, advance=advance, config=config, interpret=quick
        )

    # The advance pass does the op's state work: its states are the op's (dt_bias is 0).
    cache = make_cache()
    _, want = pk.selective_state_update(
        cache, x, dt, A, B, C, slot_ids=slots, dt_softplus=True, implementation="xla"
    )
    got = in_place_pass(
        cache, x, dt, A, B, slot_ids=slots, advance=True, config=config, interpret=quick
    )
    error = relative_error(got[slots], want[slots])
    if not error < 1e-5:
        raise SystemExit(f"{rows} rows: the advance pass is off the state update ({error:.1e})")

    cases = [
        ("copy-back", functools.partial(floor, advance=False), state_bytes),
        ("advance", functools.partial(floor, advance=True), state_bytes),
        ("state update", functools.partial(op, gate=None), op_bytes),
        ("state update, z", functools.partial(op, gate=z), op_bytes + rows * H * P * 2),
    ]
    results = []
    for name, update, nbytes in cases:
        timing = harness.time_cache_update(update, make_cache, repeats=2 if quick else 32)
        gbps = nbytes / (timing.median_ms * 1e-3) / 1e9
        results.append(
            dict(
                rows=rows,
                kernel=name,
                median_us=timing.median_ms * 1e3,
                fraction_of_copy=gbps / ceilings.copy_gbps,
                tiling=str(config),
            )
        )
        print(f"{rows:>4} rows  {name:<16} {timing.median_ms * 1e3:9.1f} µs"
              f"  {gbps / ceilings.copy_gbps:6.1%} of copy", flush=True)  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, interpret mode")
    args = parser.parse_args()
    ceilings = harness.measure_ceilings(quick=args.quick)
    print(f"copy {ceilings.copy_gbps:.0f} GB/s ({jax.devices()[0].device_kind})", flush=True)
    results = [r for rows in args.rows for r in measure(rows, ceilings, quick=args.quick)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_gbps=ceilings.copy_gbps, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
