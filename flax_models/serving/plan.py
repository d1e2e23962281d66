"""The typed plan of one engine step, from the scheduler to the step programs and back.

``Scheduler.schedule`` returns a ``StepPlan`` (what to run: the bucketed arrays, which
request each row serves, each row's sampling settings, the prefix-cache restores and state
saves); ``StepRunner.launch`` runs it and the engine keeps it as a ``LaunchedStep`` until
the host reads its tokens; ``Scheduler.land`` turns that into token events.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from flax_models.batch import StateSnapshots
from flax_models.serving.batching import StepArrays
from flax_models.serving.request import SequenceState

__all__ = ["LaunchedStep", "ScheduledSequence", "StepPlan"]


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """A request's part in a step: ``count`` tokens from ``start`` computed; ``samples``:
    its row's token is its next one (its prompt is done after this step); ``restored``: the
    step restores its prefix snapshot first."""

    seq: SequenceState
    start: int
    count: int
    samples: bool
    restored: bool


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One planned step.

    Attributes:
      arrays: the bucketed step arrays (``BatchBuilder.build``).
      scheduled: the requests it serves, decode rows first, in the order of ``rows``.
      rows: each scheduled request's row of the step's logits.
      sampling: every row's sampling settings (``sampling.sampling_arrays``).
      restore_ids: each prefill row's snapshot to restore (-1: none), or None without
        prefix caching.
      snapshots: the states this step saves, or None without prefix caching.
      taken: the snapshot entries taken for its saves, ``{request index: {block: entry}}``
        (global entries).
    """

    arrays: StepArrays
    scheduled: list[ScheduledSequence]
    rows: np.ndarray
    sampling: dict[str, np.ndarray]
    restore_ids: np.ndarray | None
    snapshots: StateSnapshots | None
    taken: dict[int, dict[int, int]]

    def taken_entries(self) -> list[int]:
        """Every snapshot entry still held for this step's saves."""
        return [entry for saves in self.taken.values() for entry in saves.values()]


@dataclasses.dataclass(frozen=True)
class LaunchedStep:
    """A step on the device whose tokens the host has not read yet: its ``plan``, the
    sampled ``tokens[R]`` (on the device), when it was launched, and the rows'
    log-probabilities (``StepRunner.launch``) when some row asked for them."""

    plan: StepPlan
    tokens: jax.Array
    launched_at: float
    logprobs: tuple[jax.Array, ...] | None = None
