"""Float64 NumPy oracles and assert helpers for numerics tests.

Every function named ``*_oracle`` recomputes one kernel of :mod:`pallas_kernels`
straight from the math in the design contract (DESIGN.md, section 5), in float64,
token by token and loop by loop. The algorithms are deliberately different from the
chunked implementations under test (the ``xla`` reference and the Pallas kernels), so a
bug shared by a kernel and its reference does not hide behind a matching oracle.

They are slow and meant for small shapes. Inputs may be anything ``np.asarray`` accepts
(NumPy arrays, JAX arrays, nested lists); they are converted to float64 (indices to
int64) and never mutated. Caches are returned as new arrays.

Typical use in a pytest numerics check::

    from pallas_kernels import ssd_scan
    from pallas_kernels.testing import assert_close, ssd_oracle, tolerance_for

    y, states = ssd_scan(x, dt, A, B, C, metadata=md, chunk_size=64)
    y_ref, states_ref = ssd_oracle(x, dt, A, B, C, query_start_loc=qsl)
    assert_close(y, y_ref, rtol=tolerance_for(x.dtype), name="y")
    assert_close(states, states_ref, rtol=tolerance_for(x.dtype), name="final_states")

``assert_close`` compares with the relative Frobenius error
``||actual - expected|| / ||expected||``: 1e-5 for float32 inputs, 2e-2 for bfloat16 or
float16 inputs (:func:`tolerance_for`). One norm over a whole array lets a few bad rows
hide among many good ones (a garbage cache slot among hundreds of correct ones), so for
caches and packed tokens compare each row on its own and check untouched slots bit for
bit::

    assert_close_per_row(y, y_ref, rtol=tolerance_for(x.dtype), name="y")  # each token
    touched = slot_ids[slot_ids >= 0]
    assert_close_per_row(new_cache[touched], cache_ref[touched], rtol=1e-5, name="cache")
    assert_slots_untouched(new_cache, old_cache, touched, name="cache")

Conventions shared by all oracles (DESIGN.md, sections 4 and 5):

* Tokens are packed: sequence ``b`` owns rows ``query_start_loc[b]:query_start_loc[b+1]``.
  Rows outside every sequence come back as 0.
* ``slot_ids`` index the first axis of a cache; ``-1`` marks a padding row or sequence,
  and so does any other id outside ``[0, S)`` (DESIGN.md §8): nothing is read or written
  for it and its output rows are 0. Cache lines not named by a slot id come back
  unchanged. If two rows name the same slot, each reads the cache as passed in and the
  later row's write wins (kernels leave this case undefined).

Where each piece lives (import the public names from ``pallas_kernels.testing`` itself):

* ``ssd``, ``state_update``, ``conv1d``, ``attention``, ``norm``, ``grouped_matmul``:
  one module per op's oracles, named after the op's folder in :mod:`pallas_kernels`.
* ``asserts``: :func:`relative_error`, the ``assert_*`` helpers and :func:`tolerance_for`.
* ``gradients``: finite-difference gradient checks (:func:`finite_difference_vjp`,
  :func:`vjp_errors`).
* ``_common`` and ``_ssm``: private helpers shared by the oracles.
"""

from ._common import ArrayLike as ArrayLike
from .asserts import (
    assert_close,
    assert_close_per_row,
    assert_slots_untouched,
    relative_error,
    tolerance_for,
)
from .attention import attention_oracle, kv_lens_from_mask_oracle, write_kv_oracle
from .conv1d import causal_conv1d_oracle, causal_conv1d_update_oracle
from .gradients import finite_difference_vjp, vjp_errors
from .grouped_matmul import grouped_matmul_oracle
from .norm import gated_rms_norm_oracle
from .ssd import ssd_oracle
from .state_update import selective_state_update_oracle

__all__ = [
    "assert_close",
    "assert_close_per_row",
    "assert_slots_untouched",
    "attention_oracle",
    "causal_conv1d_oracle",
    "causal_conv1d_update_oracle",
    "finite_difference_vjp",
    "gated_rms_norm_oracle",
    "grouped_matmul_oracle",
    "kv_lens_from_mask_oracle",
    "relative_error",
    "selective_state_update_oracle",
    "ssd_oracle",
    "tolerance_for",
    "vjp_errors",
    "write_kv_oracle",
]
