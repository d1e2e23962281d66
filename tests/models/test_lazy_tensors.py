"""Checkpoint tensors read on demand: every view reads what NumPy would compute."""

from __future__ import annotations

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from flax_models.lazy_tensors import StoredTensor, stack


def test_views_read_what_numpy_computes(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"a": rng.normal(size=(6, 1, 10)).astype(np.float32)}
    arrays |= {f"e{i}": rng.normal(size=(5, 4)).astype(np.float32) for i in range(3)}
    save_file(arrays, str(tmp_path / "t.safetensors"))
    handle = safe_open(str(tmp_path / "t.safetensors"), framework="numpy")
    a = StoredTensor(handle, "a")
    experts = [StoredTensor(handle, f"e{i}") for i in range(3)]
    assert (a.shape, a.dtype) == ((6, 1, 10), np.float32)
    order = np.array([7, 8, 9, 0, 1, 4, 5, 2, 3, 6])  # runs, as a tp-major gather makes
    cases = {
        "whole": (a, arrays["a"]),
        "conv": (a[:, 0, :], arrays["a"][:, 0, :]),
        "linear": (a[:, 0, :].T, arrays["a"][:, 0, :].T),
        "halves": (a[3:][:, 0, 2:9:3], arrays["a"][3:][:, 0, 2:9:3]),
        "taken": (a[:, 0, :].T.take(order, axis=0), arrays["a"][:, 0, :].T[order]),
        "experts": (
            stack(experts).transpose(0, 2, 1),
            np.stack([arrays[f"e{i}"] for i in range(3)]).transpose(0, 2, 1),
        ),
        # Granite's fused gate | up [2I, H] → the MLP's gate_up kernel [H, 2, I].
        "gate_up": (
            stack([a[:3, 0, :], a[3:, 0, :]]).transpose(2, 0, 1),
            arrays["a"][:, 0, :].reshape(2, 3, 10).transpose(2, 0, 1),
        ),
    }
    for name, (view, expected) in cases.items():
        assert view.shape == expected.shape, name
        np.testing.assert_array_equal(np.asarray(view), expected, err_msg=name)
        # A shard: the last axis cut in two, the first from 1 on.
        index = (slice(1, None),) + tuple(slice(0, n // 2) for n in expected.shape[1:])
        np.testing.assert_array_equal(view.read(index), expected[index], err_msg=name)
