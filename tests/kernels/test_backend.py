"""The backend registry: how an op chooses what runs a call.

A toy :class:`Op` whose fake backends record what they receive checks the rules
themselves; :func:`pallas_kernels.backend_for` on the real ops checks that every op is
wired to them.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.attention import api as attention_api
from pallas_kernels.backend import Backend, Call, Op
from pallas_kernels.conv1d import api as conv_api
from pallas_kernels.mamba_decode import api as mamba_decode_api
from pallas_kernels.mamba_prefill import api as mamba_prefill_api
from pallas_kernels.norm import api as norm_api
from pallas_kernels.norm import triton_config as norm_config
from pallas_kernels.ssd import api as ssd_api
from pallas_kernels.ssd import triton_config as ssd_config
from pallas_kernels.state_update import api as state_update_api

ON_CPU = jax.default_backend() == "cpu"
cpu_only = pytest.mark.skipif(not ON_CPU, reason="the CPU's dispatch rules")

HOPPER = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100", compute_capability="9.0")
AMPERE = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100", compute_capability="8.0")
CPU = types.SimpleNamespace(platform="cpu", device_kind="cpu")


# --------------------------------------------------------------------------- a toy op


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    block: int = 64


@dataclasses.dataclass(frozen=True)
class TritonTiles:
    block: int = 16

    def __post_init__(self):
        if self.block < 1:
            raise ValueError(f"block={self.block} must be >= 1")


class Toy:
    """``toy(n, *, limit_mosaic, limit_triton)``: mosaic serves ``n <= limit_mosaic``,
    triton ``n <= limit_triton``, xla everything. Each backend records its calls."""

    def __init__(self):
        self.calls: list[tuple[str, tuple, dict]] = []
        self.checked: list[tuple] = []
        self.defaults: list[tuple] = []

        def backend_fn(name):
            def fn(*args, **kwargs):
                self.calls.append((name, args, kwargs))
                return name

            return fn

        def too_big(key):
            def supports(n, **kwargs):
                limit = kwargs[key]
                return None if n <= limit else f"n={n} is above {key}={limit}"

            return supports

        def default(cls):
            def make(*args, **kwargs):
                self.defaults.append((cls, args, kwargs))
                return cls()

            return make

        def check(config, *args, **kwargs):
            self.checked.append((config, args, kwargs))
            if config.block > 32:
                raise ValueError(f"config.block={config.block} is too large for this call")

        self.op = Op(
            "toy",
            (
                Backend(
                    "mosaic",
                    backend_fn("mosaic"),
                    config_type=MosaicTiles,
                    default_config=default(MosaicTiles),
                    supports=too_big("limit_mosaic"),
                ),
                Backend(
                    "triton",
                    backend_fn("triton"),
                    config_type=TritonTiles,
                    default_config=default(TritonTiles),
                    supports=too_big("limit_triton"),
                    check_config=check,
                ),
                Backend("xla", backend_fn("xla")),
            ),
        )

    @staticmethod
    def call(n, *, limit_mosaic=10, limit_triton=100, empty=False, finish=None):
        return Call(
            (n,),
            dict(limit_mosaic=limit_mosaic, limit_triton=limit_triton),
            empty=(lambda: "empty") if empty else None,
            finish=finish,
        )

    def __call__(self, n, *, implementation="auto", config=None, **options):
        """The toy as a public op (what ``backend_for`` probes)."""
        return self.op.run(self.call(n, **options), implementation, config)


def picked(toy, n, implementation="auto", device=HOPPER, config=None, **options):
    return toy.op.select(toy.call(n, **options), implementation, config, device=device).backend.name


@pytest.mark.parametrize(
    ("n", "device", "expected"),
    [
        (5, HOPPER, "mosaic"),  # everything serves: the first backend
        (50, HOPPER, "triton"),  # mosaic says why not: the next one
        (500, HOPPER, "xla"),  # only xla serves
        (5, AMPERE, "triton"),  # mosaic needs Hopper
        (5, CPU, "xla"),  # auto runs Pallas kernels on a GPU only
    ],
)
def test_auto_takes_the_first_backend_that_serves(n, device, expected):
    assert picked(Toy(), n, device=device) == expected


def test_auto_with_no_backend_that_serves_raises_every_reason():
    toy = Toy()
    toy.op = dataclasses.replace(toy.op, backends=toy.op.backends[:2])  # no xla
    with pytest.raises(ValueError, match="toy") as err:
        picked(toy, 500)
    assert "n=500 is above limit_mosaic=10" in str(err.value)
    assert "n=500 is above limit_triton=100" in str(err.value)


@pytest.mark.parametrize(
    ("implementation", "n", "device", "reason"),
    [
        ("mosaic", 50, HOPPER, "n=50 is above limit_mosaic=10"),
        ("triton", 500, HOPPER, "n=500 is above limit_triton=100"),
        ("mosaic", 5, AMPERE, "Hopper"),
        ("mosaic", 5, CPU, "Hopper"),
    ],
)
def test_explicit_backend_that_cannot_serve_raises_its_reason(implementation, n, device, reason):
    """No silent hand-off to another backend: the reason is in the error."""
    with pytest.raises(ValueError, match=reason):
        picked(Toy(), n, implementation, device=device)


def test_explicit_triton_interprets_off_gpu_only():
    toy = Toy()
    for device, interpret in ((CPU, True), (HOPPER, False)):
        selection = toy.op.select(toy.call(5), "triton", device=device)
        assert (selection.backend.name, selection.interpret) == ("triton", interpret)
    assert not toy.op.select(toy.call(5), "xla", device=CPU).interpret


@pytest.mark.parametrize(
    ("names", "n", "device", "expected"),
    [
        (("mosaic", "triton"), 5, HOPPER, "mosaic"),
        (("mosaic", "triton"), 50, HOPPER, "triton"),
        (("mosaic", "triton"), 5, AMPERE, "triton"),
        (("triton", "mosaic"), 5, HOPPER, "triton"),  # the sequence's order, not the op's
        (("mosaic", "xla"), 50, HOPPER, "xla"),
        (["mosaic", "triton"], 5, CPU, "triton"),  # named: Triton interprets off-GPU
    ],
)
def test_sequence_takes_the_first_named_backend_that_serves(names, n, device, expected):
    assert picked(Toy(), n, names, device=device) == expected


def test_internal_sequence_errors():
    toy = Toy()
    with pytest.raises(ValueError, match="n=500 is above limit_triton=100") as err:
        picked(toy, 500, ("mosaic", "triton"))
    assert "n=500 is above limit_mosaic=10" in str(err.value)
    only_xla = Op("only_xla", (Backend("xla", lambda n: n),))
    # Names the op lacks are skipped; a sequence naming none of its backends raises.
    assert only_xla.select(Call((1,), {}), ("mosaic", "xla"), device=CPU).backend.name == "xla"
    with pytest.raises(ValueError, match="only_xla has none of them"):
        only_xla.select(Call((1,), {}), ("mosaic", "triton"), device=CPU)
    for bad in ((), ("cuda",), ("auto", "xla")):
        with pytest.raises(ValueError, match="a sequence must name backends"):
            picked(toy, 5, bad)


def test_internal_unknown_and_missing_names_raise():
    with pytest.raises(ValueError, match="must be one of"):
        picked(Toy(), 5, "cuda")
    only_xla = Op("only_xla", (Backend("xla", lambda n: n),))
    with pytest.raises(ValueError, match="'triton' is not available for only_xla"):
        only_xla.select(Call((1,), {}), "triton", device=HOPPER)


def test_internal_backend_entries_are_checked():
    with pytest.raises(ValueError, match="backend name"):
        Backend("cuda", lambda: None)
    with pytest.raises(ValueError, match="go together"):
        Backend("triton", lambda: None, config_type=TritonTiles)
    with pytest.raises(ValueError, match="go together"):
        Backend("triton", lambda: None, default_config=TritonTiles)


# --------------------------------------------------------------------------- config


def test_config_of_another_backend_raises_when_named():
    toy = Toy()
    with pytest.raises(ValueError, match="config of type tests.kernels.test_backend.MosaicTiles"):
        toy(5, implementation="triton", config=MosaicTiles())
    with pytest.raises(ValueError, match="config of type tests.kernels.test_backend.TritonTiles"):
        toy(5, implementation="xla", config=TritonTiles())
    with pytest.raises(ValueError, match="config of type builtins.dict"):
        toy(5, implementation="triton", config=dict(block=16))
    assert toy.calls == []


def test_config_steers_auto_to_its_backend():
    """A config fits one backend: auto skips those it is not for."""
    toy = Toy()
    assert picked(toy, 5, config=TritonTiles()) == "triton"
    assert picked(toy, 5, config=MosaicTiles()) == "mosaic"
    with pytest.raises(ValueError, match="config of type tests.kernels.test_backend.MosaicTiles"):
        picked(toy, 50, config=MosaicTiles())  # mosaic cannot serve; no other takes it


def test_internal_equal_calls_are_traced_once():
    """A model calls each kernel once a layer with equal shapes and constants: the backend
    is traced, and its kernels lowered, once per program rather than once per layer."""
    traces = []

    def scale_rows(x, *, scale):
        traces.append((x.shape, scale))
        return x * scale

    op = Op("scale_rows", (Backend("xla", scale_rows),))

    def layers(x):
        for _ in range(3):
            x = op.run(Call((x,), dict(scale=2.0)), "xla")
        return x

    x = jnp.arange(32.0).reshape(4, 8)
    np.testing.assert_array_equal(jax.jit(layers)(x), x * 8)
    assert traces == [((4, 8), 2.0)]
    # Another shape, another constant: traced again, with the constant as given.
    np.testing.assert_array_equal(op.run(Call((x[:2],), dict(scale=3.0)), "xla"), x[:2] * 3)
    assert traces[1:] == [((2, 8), 3.0)]


def test_config_reaches_the_backend_unchanged():
    toy = Toy()
    config = TritonTiles(block=4)
    assert toy(5, implementation="triton", config=config) == "triton"
    [(name, args, kwargs)] = toy.calls
    assert name == "triton" and args == (5,)
    assert kwargs["config"] is config  # the very object: validated, never rewritten
    assert toy.defaults == []  # the heuristic does not run when a config is given
    [(checked, check_args, check_kwargs)] = toy.checked
    assert checked is config and check_args == (5,)
    assert check_kwargs == dict(limit_mosaic=10, limit_triton=100)


def test_default_config_when_none_given():
    toy = Toy()
    toy(5, implementation="triton")
    [(name, _, kwargs)] = toy.calls
    [(cls, args, call_kwargs)] = toy.defaults
    assert cls is TritonTiles and args == (5,)
    assert call_kwargs == dict(limit_mosaic=10, limit_triton=100)
    assert kwargs["config"] == TritonTiles()
    assert toy.checked == []  # the heuristic's own choice is not re-checked


def test_check_config_rejects_a_config_that_cannot_serve_the_call():
    toy = Toy()
    with pytest.raises(ValueError, match="config.block=64 is too large"):
        toy(5, implementation="triton", config=TritonTiles(block=64))
    assert toy.calls == []
    with pytest.raises(ValueError, match="block=0 must be >= 1"):
        TritonTiles(block=0)  # the config type checks its own fields


@cpu_only
def test_interpret_goes_to_triton_only():
    toy = Toy()
    toy(5, implementation="triton")
    toy(5, implementation="xla")
    (_, _, triton_kwargs), (_, _, xla_kwargs) = toy.calls
    assert triton_kwargs["interpret"] is True
    assert set(xla_kwargs) == {"limit_mosaic", "limit_triton"}  # no config, no interpret


def test_empty_call_runs_no_backend_but_still_selects():
    toy = Toy()
    assert toy(5, implementation="triton", empty=True) == "empty"
    assert toy.calls == [] and toy.defaults == []
    with pytest.raises(ValueError, match="limit_triton"):
        toy(500, implementation="triton", empty=True)


def test_finish_maps_the_result():
    toy = Toy()
    assert toy(5, implementation="xla", finish=str.upper) == "XLA"


# --------------------------------------------------------------------------- backend_for


def test_backend_for_names_the_backend_and_runs_nothing():
    toy = Toy()
    assert pk.backend_for(toy, 5, implementation="xla") == "xla"
    assert pk.backend_for(toy, 5, implementation=("mosaic", "triton")) in ("mosaic", "triton")
    assert pk.backend_for(toy, 50, implementation="triton", config=TritonTiles()) == "triton"
    with pytest.raises(ValueError, match="limit_triton"):
        pk.backend_for(toy, 500, implementation="triton")
    assert toy.calls == [] and toy.defaults == [] and toy.checked == []
    # Outside backend_for the same call runs.
    assert toy(5, implementation="xla") == "xla"
    with pytest.raises(TypeError, match="not an op"):
        pk.backend_for(lambda n: n, 5)


def _norm_args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
    return (x, x, jnp.ones(16)), dict(group_size=4)


@cpu_only
def test_backend_for_real_ops_on_cpu():
    args, kwargs = _norm_args()
    assert pk.backend_for(pk.gated_rms_norm, *args, **kwargs) == "xla"
    assert pk.backend_for(pk.gated_rms_norm, *args, **kwargs, implementation="triton") == "triton"
    assert pk.backend_for(pk.gated_rms_norm, *args, **kwargs, implementation="xla") == "xla"
    config = norm_config.BlockSizes()
    assert (
        pk.backend_for(pk.gated_rms_norm, *args, **kwargs, implementation="triton", config=config)
        == "triton"
    )
    with pytest.raises(ValueError, match="'mosaic' is not available for gated_rms_norm"):
        pk.backend_for(pk.gated_rms_norm, *args, **kwargs, implementation="mosaic")
    # A Triton config asks for Triton: auto on a CPU does not run Triton kernels.
    with pytest.raises(ValueError, match="auto runs Triton kernels on a GPU only"):
        pk.backend_for(pk.gated_rms_norm, *args, **kwargs, config=config)
    with pytest.raises(ValueError, match="is not this backend's"):
        pk.backend_for(pk.gated_rms_norm, *args, **kwargs, implementation="xla", config=config)


def _attention_args(dtype=jnp.bfloat16, T=64, D=64, B=1):
    """T tokens, the first B - 1 sequences one token each, the last one the rest."""
    q = jnp.zeros((T, 4, D), dtype)
    cache = jnp.zeros((B + 1, 64, 2, D), dtype)
    qsl = jnp.asarray([*range(B), T], jnp.int32)
    kv_lens = jnp.diff(qsl)
    return (q, cache, cache), dict(
        query_start_loc=qsl, kv_lens=kv_lens, slot_ids=jnp.arange(B, dtype=jnp.int32)
    )


@cpu_only
def test_mosaic_on_cpu_raises_naming_hopper():
    """An explicit "mosaic" never falls back to Triton on a machine without Hopper."""
    args, kwargs = _attention_args()
    assert pk.backend_for(pk.masked_tail_attention, *args, **kwargs) == "xla"
    with pytest.raises(ValueError, match="Hopper"):
        pk.backend_for(pk.masked_tail_attention, *args, **kwargs, implementation="mosaic")
    with pytest.raises(ValueError, match="Hopper"):
        pk.masked_tail_attention(*args, **kwargs, implementation="mosaic")
    assert (
        pk.backend_for(
            pk.masked_tail_attention, *args, **kwargs, implementation=("mosaic", "triton")
        )
        == "triton"
    )


def test_internal_mosaic_attention_names_what_it_cannot_serve():
    """The Mosaic kernel's ``supports`` on a Hopper device: prefill in bf16/fp16, head dim
    64 or 128 (decode-shaped, fp32 and other head dims go to Triton under auto)."""
    op = attention_api.MASKED_TAIL_ATTENTION
    mosaic = op.backend("mosaic")
    for options, reason in (
        (dict(dtype=jnp.float32), "bf16 or fp16"),
        (dict(D=80), "head dim 80"),
        (dict(T=60), "multiples of 8"),
        (dict(T=8, B=8), "decode-shaped"),
    ):
        args, kwargs = _attention_args(**options)
        assert reason in mosaic.supports(*args, **kwargs)
    for options in (dict(), dict(dtype=jnp.float16, D=128), dict(T=16, B=8)):
        args, kwargs = _attention_args(**options)
        assert mosaic.supports(*args, **kwargs) is None


@pytest.mark.parametrize(
    "op",
    [
        ssd_api.SSD_SCAN,
        state_update_api.SELECTIVE_STATE_UPDATE,
        conv_api.CAUSAL_CONV1D,
        conv_api.CAUSAL_CONV1D_UPDATE,
        attention_api.MASKED_TAIL_ATTENTION,
        attention_api.WRITE_KV,
        norm_api.GATED_RMS_NORM,
        norm_api.RMS_NORM,
        mamba_decode_api.MAMBA2_DECODE,
        mamba_prefill_api.MAMBA2_PREFILL,
    ],
    ids=lambda op: op.name,
)
def test_internal_every_op_has_xla_last_and_pallas_backends_take_configs(op):
    """xla serves every call, so auto always finds a backend; it comes last (the Pallas
    kernels are preferred where they run) and takes no block sizes; every Pallas backend
    but ``write_kv``'s (a copy) does (``mamba2_decode``'s and ``mamba2_prefill``'s: their
    kernels' own)."""
    assert op.names[-1] == "xla" and op.backend("xla").config_type is None
    assert len(set(op.names)) == len(op.names)
    for backend in op.backends[:-1]:
        assert backend.name in ("triton", "mosaic")
        if op is not attention_api.WRITE_KV:
            assert backend.config_type is not None


@cpu_only
def test_a_config_of_another_op_is_refused():
    args, kwargs = _norm_args()
    with pytest.raises(ValueError, match="config of type"):
        pk.gated_rms_norm(*args, **kwargs, implementation="triton", config=ssd_config.BlockSizes())


def _int_block_size_types() -> list[type]:
    """Every block-size dataclass of every op whose fields are ints (or None)."""
    from pallas_kernels.attention import mosaic_config as attention_mosaic_config
    from pallas_kernels.attention import triton_config as attention_config
    from pallas_kernels.conv1d import triton_config as conv_config
    from pallas_kernels.grouped_matmul import mosaic as grouped_mosaic
    from pallas_kernels.grouped_matmul import triton_config as grouped_config
    from pallas_kernels.ssd import mosaic_config as ssd_mosaic_config
    from pallas_kernels.state_update import triton_config as state_update_config

    return [
        ssd_config.BlockSizes, ssd_config.BackwardBlockSizes, ssd_mosaic_config.BlockSizes,
        conv_config.BlockSizes, state_update_config.BlockSizes, norm_config.BlockSizes,
        attention_config.BlockSizes, attention_config.BackwardBlockSizes,
        attention_mosaic_config.BlockSizes, grouped_config.BlockSizes, grouped_mosaic.BlockSizes,
    ]  # fmt: skip


@pytest.mark.parametrize("config_type", _int_block_size_types(), ids=lambda t: t.__module__)
def test_block_sizes_refuse_fields_that_are_not_ints(config_type):
    """A block size given as a string, a float or a bool raises ``ValueError`` naming the
    field (before, the range checks raised ``TypeError`` comparing it)."""
    defaults = config_type()
    field = next(f.name for f in dataclasses.fields(defaults) if getattr(defaults, f.name))
    default = getattr(defaults, field)
    assert isinstance(default, int) and config_type(**{field: np.int64(default)})
    for bad in (str(default), float(default), True):
        with pytest.raises(ValueError, match=f"{field}=.* must be an int"):
            config_type(**{field: bad})


def test_block_sizes_bool_fields_refuse_ints():
    """A field declared ``bool`` (the state update's ``unroll_heads``) takes only bools."""
    from pallas_kernels.state_update import triton_config as state_update_config

    assert state_update_config.BlockSizes(unroll_heads=True).unroll_heads
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="unroll_heads=.* must be a bool"):
            state_update_config.BlockSizes(unroll_heads=bad)


@cpu_only
def test_static_int_arguments_refuse_floats():
    """``sliding_window`` and ``group_size`` are whole numbers: 2.5 was truncated to 2 and
    4.0 accepted; ``chunk_metadata`` refuses float token counts and takes lists."""
    args, kwargs = _norm_args()
    with pytest.raises(ValueError, match="group_size=4.0 must be an int"):
        pk.gated_rms_norm(*args, **(kwargs | dict(group_size=4.0)))
    q, k = np.ones((2, 2, 16), np.float32), np.ones((3, 8, 1, 16), np.float32)
    batch = dict(query_start_loc=[0, 1, 2], kv_lens=[4, 5], slot_ids=[0, 2])
    with pytest.raises(ValueError, match="sliding_window=2.5 must be an int"):
        pk.masked_tail_attention(q, k, k, sliding_window=2.5, **batch)
    with pytest.raises(ValueError, match="query_start_loc must be an integer array"):
        pk.chunk_metadata(np.array([0.0, 5.5]), np.array([0]), chunk_size=4, max_chunks=4)
    metadata = pk.chunk_metadata([0, 5], [3], chunk_size=4, max_chunks=4)
    assert metadata.cu_chunk_seqlens.tolist()[:3] == [0, 1, 5]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda a, k: pk.gated_rms_norm(*a, **(k | dict(eps="a"))), "eps='a' must be a number"),
        (lambda a, k: pk.gated_rms_norm(*a, **(k | dict(eps=None))), "eps=None must be a number"),
        (lambda a, k: pk.rms_norm(a[0], a[2], eps=None), "eps=None must be a number"),
        (lambda a, k: pk.gated_rms_norm(*a, **k, implementation=None), "implementation=None"),
        (lambda a, k: pk.gated_rms_norm(*a, **k, implementation=3), "implementation=3"),
        (lambda a, k: _ssd_call(chunk_size="4"), "chunk_size='4' must be an int"),
        (lambda a, k: _ssd_call(chunk_size=4.0), "chunk_size=4.0 must be an int"),
        (lambda a, k: _ssd_call(dt_limit=(1.0,)), r"dt_limit=\(1.0,\) must be a pair"),
        (lambda a, k: _ssd_call(dt_limit=("a", 1.0)), r"dt_limit\[0\]='a' must be a number"),
        (lambda a, k: _attention_call(sm_scale="x"), "sm_scale='x' must be a number"),
    ],
)
def test_bad_static_arguments_raise_value_errors_naming_them(call, match):
    """DESIGN §5: a bad static argument raises ValueError naming it (before: TypeErrors
    from comparisons and iteration, or a float() error without the argument's name)."""
    args, kwargs = _norm_args()
    with pytest.raises(ValueError, match=match):
        call(args, kwargs)


def _ssd_call(**options):
    T, H, P, N = 8, 2, 4, 4
    metadata = pk.chunk_metadata([0, 5, 8], [0, 0], chunk_size=4, max_chunks=6)
    x, dt, B = jnp.ones((T, H, P)), jnp.ones((T, H)), jnp.ones((T, 1, N))
    kwargs = dict(metadata=metadata, chunk_size=4) | options
    return pk.ssd_scan(x, dt, -jnp.ones(H), B, B, implementation="xla", **kwargs)


def _attention_call(**options):
    q, k = jnp.ones((3, 2, 8)), jnp.ones((2, 8, 1, 8))
    batch = dict(query_start_loc=[0, 3], kv_lens=[3], slot_ids=[0])
    return pk.masked_tail_attention(q, k, k, **batch, implementation="xla", **options)
