"""Implementation choice: the ``auto`` rule and clear errors."""

from __future__ import annotations

import jax
import pytest

from pallas_kernels.backend import Backend, dispatch, resolve


def test_xla_always_available():
    assert resolve("xla", op="op", available={"xla"}) == Backend("xla")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU rule")
def test_auto_on_cpu_is_xla_and_triton_interprets():
    assert resolve("auto", op="op", available={"xla", "triton", "mosaic"}).name == "xla"
    assert resolve("triton", op="op", available={"xla", "triton"}) == Backend("triton", True)


def test_unknown_and_missing_implementations_raise():
    with pytest.raises(ValueError, match="must be one of"):
        resolve("cuda", op="op", available={"xla"})
    with pytest.raises(ValueError, match="not available for my_op"):
        resolve("triton", op="my_op", available={"xla"})


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU rule")
def test_mosaic_needs_hopper():
    with pytest.raises(ValueError, match="Hopper"):
        resolve("mosaic", op="op", available={"xla", "mosaic"})


def test_dispatch_passes_interpret_to_triton_only():
    calls = {}
    table = {
        "xla": lambda a, **kw: calls.setdefault("xla", kw),
        "triton": lambda a, **kw: calls.setdefault("triton", kw),
    }
    dispatch(table, "xla", 1, op="op", k=2)
    dispatch(table, "triton", 1, op="op", k=2)
    assert calls["xla"] == {"k": 2}
    assert calls["triton"] == {"k": 2, "interpret": jax.default_backend() != "gpu"}
