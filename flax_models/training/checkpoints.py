"""Training checkpoints on orbax-checkpoint: the model's variables, the optimizer's state
and step, under a step number, in ``orbax.checkpoint.CheckpointManager``'s layout
(``directory/<step>/model``, ``directory/<step>/optimizer``).

A restored run continues exactly where the saved one stopped: every variable (parameters,
adapters, router biases, Adam's moments, accumulation sums, schedule counts) comes back
bit for bit, into the shardings the model and optimizer already have (a model on a mesh
restores onto the mesh; each process reads its own shards). For the weights alone, in the
Hugging Face layout, use ``flax_models.save_hf_checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from flax_models.model import HybridLM


def _manager(directory: str | Path, max_to_keep: int | None = None) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def _states(model: HybridLM, optimizer: nnx.Optimizer) -> dict[str, nnx.State]:
    return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}


def save_checkpoint(
    directory: str | Path,
    model: HybridLM,
    optimizer: nnx.Optimizer,
    *,
    step: int,
    max_to_keep: int | None = None,
) -> None:
    """Saves ``model``'s and ``optimizer``'s variables as checkpoint ``step`` under
    ``directory`` (created if missing), and waits until it is written. ``max_to_keep``: the
    older steps beyond that many are deleted (None keeps all). ``ValueError`` when
    ``step`` is already saved there. Under several processes every process calls it."""
    with _manager(directory, max_to_keep) as manager:
        if step in manager.all_steps():
            raise ValueError(f"checkpoint {step=} already exists in {directory}")
        items = {
            k: ocp.args.StandardSave(nnx.to_pure_dict(s))
            for k, s in _states(model, optimizer).items()
        }
        manager.save(step, args=ocp.args.Composite(**items))
        manager.wait_until_finished()


def restore_checkpoint(
    directory: str | Path,
    model: HybridLM,
    optimizer: nnx.Optimizer,
    *,
    step: int | None = None,
) -> int:
    """Restores checkpoint ``step`` (default the latest) of ``directory`` into ``model`` and
    ``optimizer`` (in place; they must have the saved structure: the same config, adapters
    and optimizer) and returns its step. ``FileNotFoundError`` when there is none."""
    with _manager(directory) as manager:
        step = manager.latest_step() if step is None else step
        if step is None or step not in manager.all_steps():
            raise FileNotFoundError(f"no checkpoint {'' if step is None else step} in {directory}")
        states = _states(model, optimizer)
        targets = {
            k: ocp.args.StandardRestore(jax.tree.map(_abstract, nnx.to_pure_dict(s)))
            for k, s in states.items()
        }
        restored = manager.restore(step, args=ocp.args.Composite(**targets))
    for key, state in states.items():
        nnx.replace_by_pure_dict(state, restored[key])
    nnx.update(model, states["model"])
    nnx.update(optimizer, states["optimizer"])
    return int(step)


def _abstract(array: jax.Array) -> jax.ShapeDtypeStruct:
    """Where a restored array goes: its shape, dtype and sharding now."""
    return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding)
