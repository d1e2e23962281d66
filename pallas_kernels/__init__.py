"""Pallas GPU kernels for hybrid Mamba2/attention models, behind a functional API.

Shape letters used throughout: T packed tokens, B sequences, S cache slots, H heads,
G groups, P head dim, N state size, K conv width, L cache length, D attention head dim.
Every op takes ``implementation="auto" | "xla" | "triton" | "mosaic"`` (``IMPLEMENTATIONS``),
or a sequence of backend names (``backend_names`` checks one).

Besides the ops: ``slots`` (gather and scatter per-sequence states by cache slot id),
``search_sorted`` (``jnp.searchsorted`` for a step's short sorted arrays) and
``check_int`` (the int-argument check every op applies, for callers that validate their
own arguments with the same messages). Everything else in the package is internal.
"""

from pallas_kernels import slots
from pallas_kernels._common import matmul_precision, search_sorted
from pallas_kernels._validation import check_int
from pallas_kernels.all_reduce import all_reduce
from pallas_kernels.attention import kv_lens_from_mask, masked_tail_attention, write_kv
from pallas_kernels.backend import IMPLEMENTATIONS, Implementation, backend_for, backend_names
from pallas_kernels.conv1d import causal_conv1d, causal_conv1d_update
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.mamba_decode import mamba2_decode
from pallas_kernels.mamba_prefill import mamba2_prefill
from pallas_kernels.metadata import (
    ChunkMetadata,
    bucket_for,
    chunk_metadata,
    max_chunks_for,
    pad_to_bucket,
    sequence_buckets,
    token_buckets,
)
from pallas_kernels.norm import gated_rms_norm, rms_norm
from pallas_kernels.ssd import ssd_scan
from pallas_kernels.state_update import selective_state_update

__all__ = [
    "IMPLEMENTATIONS",
    "ChunkMetadata",
    "Implementation",
    "all_reduce",
    "backend_for",
    "backend_names",
    "bucket_for",
    "causal_conv1d",
    "causal_conv1d_update",
    "check_int",
    "chunk_metadata",
    "gated_rms_norm",
    "grouped_matmul",
    "kv_lens_from_mask",
    "mamba2_decode",
    "mamba2_prefill",
    "masked_tail_attention",
    "matmul_precision",
    "max_chunks_for",
    "pad_to_bucket",
    "rms_norm",
    "search_sorted",
    "selective_state_update",
    "sequence_buckets",
    "slots",
    "ssd_scan",
    "token_buckets",
    "write_kv",
]
