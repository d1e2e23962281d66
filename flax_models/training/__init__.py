"""Training a ``HybridLM``: losses on padded and packed batches, optimizers and schedules,
the train step, evaluation, orbax checkpoints of a run.

- ``losses``: :func:`loss_fn` (padded ``[B, L]`` rows), :func:`packed_loss_fn` (packed
  sequences, the kernels' varlen layout), :func:`pack_documents` (several documents per
  row, kept apart), :func:`pad_sequences`, :data:`IGNORE_INDEX`.
- ``optimizer``: :func:`make_optimizer` (``trainable`` filter, ``accumulate``),
  :func:`default_optimizer` (AdamW in fp32, with a :func:`warmup_cosine` schedule).
- ``step``: :func:`train_step`. ``evaluate``: :func:`evaluate` (loss and perplexity).
- ``checkpoints``: :func:`save_checkpoint` / :func:`restore_checkpoint` (orbax).
- ``fsdp``: :func:`shard_fsdp` / :func:`shard_batch` (a mesh axis ``"fsdp"`` splits the
  parameters, optimizer state and batch rows; composable with ``"tp"``).
"""

from flax_models.training.checkpoints import restore_checkpoint, save_checkpoint
from flax_models.training.evaluate import evaluate
from flax_models.training.fsdp import FSDP, fsdp_spec, shard_batch, shard_fsdp
from flax_models.training.losses import (
    IGNORE_INDEX,
    LossFn,
    PackedBatch,
    loss_fn,
    next_token_cross_entropy,
    pack_documents,
    packed_labels,
    packed_loss,
    packed_loss_fn,
    pad_sequences,
    scored_targets,
)
from flax_models.training.optimizer import (
    default_optimizer,
    fp32_state,
    make_optimizer,
    warmup_cosine,
)
from flax_models.training.step import train_step

__all__ = [
    "FSDP",
    "IGNORE_INDEX",
    "LossFn",
    "PackedBatch",
    "default_optimizer",
    "evaluate",
    "fp32_state",
    "fsdp_spec",
    "loss_fn",
    "make_optimizer",
    "next_token_cross_entropy",
    "pack_documents",
    "packed_labels",
    "packed_loss",
    "packed_loss_fn",
    "pad_sequences",
    "restore_checkpoint",
    "save_checkpoint",
    "scored_targets",
    "shard_batch",
    "shard_fsdp",
    "train_step",
    "warmup_cosine",
]
