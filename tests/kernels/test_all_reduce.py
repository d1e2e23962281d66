"""``all_reduce``: the sum over a mesh axis (``psum`` or the one-shot Mosaic GPU kernel)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from flax_models.sharding import psum_tp
from pallas_kernels.all_reduce import api, mosaic
from pallas_kernels.backend import supports_mosaic
from tests.helpers import _H100, cpu_devices_env, run_python


def _over_axis(fn, *arrays):
    """``fn`` with the leading axis of ``arrays`` bound as ``"tp"`` (as shard_map's would)."""
    return jax.vmap(fn, axis_name="tp")(*arrays)


def test_xla_sums_every_array_of_a_tuple_over_the_axis():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 3, 40)), jnp.float32)
    squares = jnp.asarray(rng.random((4, 3)), jnp.float32)
    out, out_squares = _over_axis(
        lambda a, b: pk.all_reduce((a, b), "tp", implementation="xla"), x, squares
    )
    np.testing.assert_allclose(out, np.broadcast_to(np.sum(x, 0), x.shape), rtol=1e-6)
    np.testing.assert_allclose(out_squares, np.broadcast_to(np.sum(squares, 0), squares.shape))


def test_internal_routing_by_request_devices_and_bytes():
    rows = lambda n: [jax.ShapeDtypeStruct((n, 4096), jnp.bfloat16)]  # noqa: E731
    assert api.in_kernel_window(rows(256), 2)  # 2 MiB: measured faster
    assert not api.in_kernel_window(rows(1), 2)  # 8 KiB: NCCL's latency is lower
    assert not api.in_kernel_window(rows(128), 2)  # 1 MiB: not measured against psum
    assert not api.in_kernel_window(rows(256), 4)  # not measured on four devices
    assert not api.in_kernel_window(rows(4096), 2)  # 32 MiB: above the measured window
    chosen = []

    def probe(v, implementation):
        chosen.append(pk.backend_for(pk.all_reduce, v, "tp", implementation=implementation))
        return v

    window, small = jnp.zeros((2, 256, 4096), jnp.bfloat16), jnp.zeros((2, 1, 4096))
    family = ("mosaic", "triton", "xla")
    for x, implementation in ((window, "auto"), (window, family), (small, family)):
        _over_axis(lambda v, i=implementation: probe(v, i), x)
    # auto keeps psum; a family naming mosaic takes the kernel in its window where the
    # device runs it (a Hopper GPU), psum elsewhere.
    assert chosen == ["xla", "mosaic" if supports_mosaic() else "xla", "xla"]


def test_internal_window_is_one_process(monkeypatch):
    rows = [jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16)]
    assert api.in_kernel_window(rows, 2)
    # One GPU a process: the kernel has only run with one process driving every GPU.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert not api.in_kernel_window(rows, 2)


def _mesh_like(ids, **axes):
    """What ``kernel_mesh`` reads of a mesh (device ids, axis sizes), for orders of devices
    a one-device test process cannot build."""
    return types.SimpleNamespace(device_ids=np.array(ids).reshape(tuple(axes.values())), shape=axes)


def test_model_all_reduces_ask_for_the_window_where_the_kernel_lowers(monkeypatch):
    """A model's ``auto`` asks all_reduce for ("mosaic", "xla") on a mesh Mosaic lowers
    for (device ids row-major, tp the only axis of several devices) and psum on any
    other; one backend name goes as a one-name family."""
    asked = []
    # flax_models.sharding calls pk.all_reduce: the public op is what it asks.
    monkeypatch.setattr(
        pk, "all_reduce", lambda x, axis, implementation: asked.append(implementation)
    )
    row_major = _mesh_like([0, 1], tp=2)
    cases = [
        ("auto", row_major, ("mosaic", "xla")),
        ("mosaic", row_major, ("mosaic",)),
        ("triton", row_major, ("triton",)),
        (("mosaic", "triton"), row_major, ("mosaic", "triton")),
        ("auto", _mesh_like([1, 0], tp=2), "xla"),  # Mosaic's lowering would raise
        ("mosaic", _mesh_like([2, 3], tp=2), "xla"),
        ("auto", _mesh_like([0, 1, 2, 3], dp=2, tp=2), "xla"),
        ("auto", _mesh_like([0, 1], dp=1, tp=2), ("mosaic", "xla")),
        ("auto", None, "xla"),
    ]
    for implementation, mesh, _ in cases:
        psum_tp(jnp.zeros(2), implementation, mesh)
    assert asked == [expected for _, _, expected in cases]


def test_a_layers_implementation_is_a_preference():
    """psum_tp takes the layer's implementation: "triton" (no all-reduce of its own) still
    sums with psum instead of raising, as the layers did before they passed it."""
    x = jnp.arange(8.0).reshape(2, 4)
    for implementation in ("auto", "xla", "triton", ("mosaic", "triton")):
        out = _over_axis(lambda v, i=implementation: psum_tp(v, i), x)
        np.testing.assert_array_equal(out, np.broadcast_to(np.sum(x, 0), x.shape))


def test_bad_arguments():
    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="axis_name='dp' is not a mesh axis"):
        _over_axis(lambda v: pk.all_reduce(v, "dp"), x)
    with pytest.raises(ValueError, match="a sequence must name backends"):
        _over_axis(lambda v: pk.all_reduce(v, "tp", implementation=("nccl",)), x)
    with pytest.raises(ValueError, match="no backend of all_reduce takes block sizes"):
        _over_axis(lambda v: pk.all_reduce(v, "tp", config=object()), x)
    np.testing.assert_array_equal(_over_axis(lambda v: pk.all_reduce(v, "tp", config=None), x),
                                  np.broadcast_to(np.sum(x, 0), x.shape))  # fmt: skip
    with pytest.raises(ValueError, match=r"x\[1\] must be a floating-point array"):
        _over_axis(lambda v: pk.all_reduce((v, v.astype(jnp.int32)), "tp"), x)
    if not supports_mosaic():
        with pytest.raises(ValueError, match="Hopper"):
            _over_axis(lambda v: pk.all_reduce(v, "tp", implementation="mosaic"), x)


_BACKWARD_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from pallas_kernels.all_reduce import mosaic

launches = []
def launch(arrays, *, axis_name):  # the kernel's launch, stood in for by psum
    launches.append(len(arrays))
    return jax.lax.psum(arrays, axis_name)
mosaic.summed_over_devices = launch

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))
rng = np.random.default_rng(1)
x, squares = jnp.asarray(rng.standard_normal((4, 8))), jnp.asarray(rng.random((4,)))
wx, ws = jnp.asarray(rng.standard_normal(x.shape)), jnp.asarray(rng.standard_normal(4))
specs = dict(mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=(P("tp"), P("tp")))

def grads(sum_fn, check_vma, square):
    summed = jax.shard_map(lambda a, b: sum_fn((a, b)), check_vma=check_vma, **specs)
    def loss(x, s):
        y, t = summed(x, s)
        return jnp.sum(wx * (y * y if square else y)) + jnp.sum(ws * t)
    return jax.grad(loss, argnums=(0, 1))(x, squares)

kernel = lambda v: mosaic.all_reduce(v, axis_name="tp")
psum = lambda v: jax.lax.psum(v, "tp")
# Without shard_map's check: device d holds rows [2d, 2d + 2), and its input's gradient of
# a linear loss is the sum of both devices' output cotangents, the same on both.
gx, gs = grads(kernel, False, False)
halves = lambda w: np.concatenate([np.asarray(w)[:2] + np.asarray(w)[2:]] * 2)
np.testing.assert_allclose(gx, halves(wx), rtol=1e-6)
np.testing.assert_allclose(gs, halves(ws), rtol=1e-6)
assert launches == [2, 2], launches  # one launch forward, one backward
# And psum's own gradients, with and without the check, for a loss of the sums' squares.
for check_vma in (False, True):
    for ours, psums in zip(grads(kernel, check_vma, True), grads(psum, check_vma, True)):
        np.testing.assert_allclose(ours, psums, rtol=1e-6)
print("ok")
"""


def test_mosaic_backward_sums_the_cotangents():
    """The kernel's VJP over two CPU devices, its launches stood in for by psum (no Mosaic
    GPU on a CPU): without shard_map's check every device's output is the sum of every
    device's input, so each input's gradient is the sum over devices of the outputs'
    cotangents (one launch forward, one backward); with and without the check, the
    gradients are psum's own."""
    done = run_python(_BACKWARD_SCRIPT, env=cpu_devices_env(2), timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_one_device_returns_its_input():
    x = jnp.arange(6.0).reshape(1, 6)
    np.testing.assert_array_equal(_over_axis(lambda v: pk.all_reduce(v, "tp"), x), x)


def _lower_mosaic(devices: int, shapes, *, grad: bool = False, check_vma: bool = True) -> str:
    mesh = jax.sharding.AbstractMesh((devices,), ("tp",), abstract_device=_H100)
    split = jax.sharding.NamedSharding(mesh, P("tp"))
    args = [jax.ShapeDtypeStruct((devices * s[0], *s[1:]), dt, sharding=split) for s, dt in shapes]
    with jax.sharding.use_abstract_mesh(mesh):
        fn = jax.shard_map(
            lambda *xs: mosaic.all_reduce(xs, axis_name="tp"),
            mesh=mesh,
            in_specs=(P("tp"),) * len(args),
            out_specs=(P("tp"),) * len(args),
            check_vma=check_vma,
        )
        if grad:  # the gradient of the first output's sum of squares
            fn = jax.grad(lambda *xs, fn=fn: jnp.sum(jnp.square(fn(*xs)[0])))
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("devices", [2, 4])
def test_mosaic_lowers_as_one_collective_launch_behind_the_barrier(devices):
    """One kernel for the tuple; it reads peers through XLA's collective metadata and keeps
    the cross-device barrier its protocol relies on (operands written, semaphores zeroed
    on every device before any peer reads or signals)."""
    text = _lower_mosaic(devices, [((256, 4096), jnp.bfloat16), ((3,), jnp.float32)])
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1
    assert "uses_xla_collective_metadata = true" in calls[0]
    assert "skip_device_barrier = false" in calls[0]


def test_mosaic_gradient_lowers_as_a_second_launch():
    """Under the model's ``shard_map(check_vma=False)`` the backward pass is the kernel
    again, on the cotangents (no psum): a loss that needs the forward's sums launches it
    twice."""
    text = _lower_mosaic(2, [((256, 4096), jnp.float32)], grad=True, check_vma=False)
    assert text.count("custom_call @mosaic_gpu") == 2
    assert "stablehlo.all_reduce" not in text


def test_internal_flat_operands_pad_to_whole_vectors():
    parts = mosaic.flat_operands(
        (
            jnp.ones((3, 5), jnp.bfloat16),
            jnp.ones((7,), jnp.float32),
            jnp.ones((1024,), jnp.bfloat16),
        )
    )
    assert [p.shape for p in parts] == [(1024,), (512,), (1024,)]
    assert float(parts[0].astype(jnp.float32).sum()) == 15.0  # the padding is zeros


@pytest.mark.gpu
@pytest.mark.skipif(jax.device_count() < 2 or not supports_mosaic(), reason="two Hopper GPUs")
@pytest.mark.parametrize("rows", [1, 3, 256])
def test_mosaic_equals_psum_on_two_gpus(rows):
    """Every device gets the same bits, equal to psum's (two devices: one add each)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((2 * rows, 4096)), jnp.bfloat16)
    squares = jnp.asarray(rng.random((2 * rows,)), jnp.float32)
    run = lambda impl: jax.jit(  # noqa: E731
        jax.shard_map(
            lambda a, b: pk.all_reduce((a, b), "tp", implementation=impl),
            mesh=mesh,
            in_specs=(P("tp"), P("tp")),
            out_specs=(P("tp"), P("tp")),
            check_vma=False,
        )
    )(x, squares)
    (a, b), (c, d) = run("mosaic"), run("xla")
    a, c = np.asarray(a.astype(jnp.float32)), np.asarray(c.astype(jnp.float32))
    np.testing.assert_array_equal(a[:rows], a[rows:])
    np.testing.assert_array_equal(a, c)
    np.testing.assert_allclose(np.asarray(b), np.asarray(d), rtol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(jax.device_count() < 2 or not supports_mosaic(), reason="two Hopper GPUs")
def test_mosaic_gradient_equals_psums_on_two_gpus():
    """jax.grad through the kernel (its backward is the kernel on the cotangents) gives
    psum's gradient on every device."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2 * 256, 4096)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def grad(impl):
        summed = jax.shard_map(
            lambda a: pk.all_reduce(a, "tp", implementation=impl),
            mesh=mesh,
            in_specs=P("tp"),
            out_specs=P("tp"),
            check_vma=False,
        )
        return np.asarray(jax.jit(jax.grad(lambda a: jnp.sum(weight * summed(a))))(x))

    np.testing.assert_array_equal(grad("mosaic"), grad("xla"))
