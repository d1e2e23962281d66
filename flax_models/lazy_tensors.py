"""Tensors of safetensors files read on demand, through views that transform them.

A checkpoint tensor opens as a ``LazyTensor`` that holds its shape and dtype and reads
nothing. The name table's transforms (``.T``, ``transpose``, basic indexing, ``take``
along one axis, ``stack``) make views, still reading nothing, so ``load_hf_checkpoint``
checks every shape before it reads a byte, and a sharded load reads, for each device,
the part of each file its shard needs (``read(index)``: a tp=4 load of a split
parameter reads each element once, not four times).

A view reads by mapping the requested positions back through its transforms to the
file, which is read with slices: one slice per contiguous run of positions along the
axis that has several runs (the tp-major layouts gather a device's heads of each segment:
``z_d | x_d | B_d | C_d | dt_d``), the covering range along the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Per axis, the positions read along it (an outer product of the axes' positions).
Positions = tuple[np.ndarray, ...]


class LazyTensor:
    """A tensor read on demand. ``shape``, ``dtype``; ``read(index)`` for a tuple of
    slices (or ``positions``) gives the NumPy array there; ``np.asarray`` reads it all."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def positions(self, positions: Positions) -> np.ndarray:
        """The elements at ``positions`` (one integer array per axis, outer product)."""
        raise NotImplementedError

    def read(self, index: Sequence[slice] | None = None) -> np.ndarray:
        """The elements at ``index`` (a tuple of slices, e.g. a shard's; all when None)."""
        index = tuple(index or ()) + (slice(None),) * (self.ndim - len(index or ()))
        return self.positions(
            tuple(np.arange(n)[s] for n, s in zip(self.shape, index, strict=True))
        )

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        array = self.read()
        return array if dtype is None else array.astype(dtype)

    @property
    def T(self) -> LazyTensor:  # noqa: N802 (NumPy's name)
        return self.transpose(*reversed(range(self.ndim)))

    def transpose(self, *axes: int) -> LazyTensor:
        return _Transposed(self, tuple(axes))

    def take(self, indices: np.ndarray, axis: int) -> LazyTensor:
        return _Taken(self, np.asarray(indices), axis % self.ndim)

    def __getitem__(self, key) -> LazyTensor:
        """Basic indexing: ints drop their axis, slices keep it."""
        key = key if isinstance(key, tuple) else (key,)
        key = key + (slice(None),) * (self.ndim - len(key))
        return _Indexed(self, key)

    def __len__(self) -> int:
        return self.shape[0]


class StoredTensor(LazyTensor):
    """A tensor of a safetensors file: ``handle`` from ``safe_open(path, "numpy")``."""

    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())
        empty = self._slice[tuple(slice(0, 0) for _ in self.shape)] if self.shape else None
        self.dtype = empty.dtype if empty is not None else self._slice[...].dtype

    def positions(self, positions: Positions) -> np.ndarray:
        if not self.shape:
            return np.asarray(self._slice[...])
        if any(p.size == 0 for p in positions):
            return np.empty(tuple(p.size for p in positions), self.dtype)
        runs = [_runs(p) for p in positions]
        lows = [int(p.min()) for p in positions]
        cover = [slice(low, int(p.max()) + 1) for low, p in zip(lows, positions, strict=True)]
        if all(len(r) == 1 for r in runs):  # one block, e.g. a whole tensor: no gather
            return np.asarray(self._slice[tuple(cover)])
        split = next(a for a, r in enumerate(runs) if len(r) > 1)
        blocks = []
        for run in runs[split]:
            cover[split] = slice(int(run[0]), int(run[-1]) + 1)
            block = np.asarray(self._slice[tuple(cover)])
            local = [p - low for p, low in zip(positions, lows, strict=True)]
            local[split] = np.arange(len(run))
            blocks.append(block[np.ix_(*local)])
        return np.concatenate(blocks, axis=split)


def _runs(positions: np.ndarray) -> list[np.ndarray]:
    """``positions`` cut where they stop increasing by one."""
    return np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1)


class _Transposed(LazyTensor):
    def __init__(self, base: LazyTensor, axes: tuple[int, ...]):
        self.base, self.axes = base, axes
        self.shape, self.dtype = tuple(base.shape[a] for a in axes), base.dtype

    def positions(self, positions: Positions) -> np.ndarray:
        source = [None] * self.ndim
        for out_axis, in_axis in enumerate(self.axes):
            source[in_axis] = positions[out_axis]
        return self.base.positions(tuple(source)).transpose(self.axes)


class _Taken(LazyTensor):
    def __init__(self, base: LazyTensor, indices: np.ndarray, axis: int):
        self.base, self.indices, self.axis = base, indices, axis
        shape = list(base.shape)
        shape[axis] = len(indices)
        self.shape, self.dtype = tuple(shape), base.dtype

    def positions(self, positions: Positions) -> np.ndarray:
        source = list(positions)
        source[self.axis] = self.indices[positions[self.axis]]
        return self.base.positions(tuple(source))


class _Indexed(LazyTensor):
    def __init__(self, base: LazyTensor, key: tuple):
        self.base, self.key = base, key
        self.shape = tuple(
            len(range(*k.indices(n)))
            for k, n in zip(key, base.shape, strict=True)
            if isinstance(k, slice)
        )
        self.dtype = base.dtype

    def positions(self, positions: Positions) -> np.ndarray:
        source, dropped, kept = [], [], iter(positions)
        for axis, (k, n) in enumerate(zip(self.key, self.base.shape, strict=True)):
            if isinstance(k, slice):
                source.append(np.arange(n)[k][next(kept)])
            else:
                source.append(np.asarray([k % n]))
                dropped.append(axis)
        return self.base.positions(tuple(source)).squeeze(axis=tuple(dropped))


class _Stacked(LazyTensor):
    def __init__(self, parts: Sequence[LazyTensor]):
        self.parts = list(parts)
        self.shape = (len(self.parts), *self.parts[0].shape)
        self.dtype = self.parts[0].dtype

    def positions(self, positions: Positions) -> np.ndarray:
        rest = tuple(positions[1:])
        if not positions[0].size:
            return np.empty(tuple(p.size for p in positions), self.dtype)
        return np.stack([self.parts[int(e)].positions(rest) for e in positions[0]])


def stack(parts: Sequence) -> LazyTensor | np.ndarray:
    """``np.stack(parts)``, as a view when they are lazy (they must share a shape)."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.stack(parts)
    return _Stacked(parts)
