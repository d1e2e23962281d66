"""Low-rank adapters (LoRA, Hu et al., arXiv 2106.09685) on a ``HybridLM``'s projections.

``add_lora(model, rank=r, alpha=a)`` gives each targeted projection ``W[K, N]`` two
``nnx.LoRAParam`` factors, ``lora_a[K, r]`` (random) and ``lora_b[r, N]`` (zeros, so the
model computes what it did), and its output becomes ``x W + (a / r) · (x A) B``: the
low-rank path runs as two thin products beside the frozen one, so training the adapters
computes no weight gradient of ``W``. The projection keeps its place and its parameter
names (``…in_proj.kernel``), so checkpoints, sharding rules and ``save_hf_checkpoint``
read it as before; it only changes class (``LoRALinear``, ``LoRAEinsum``).

Targets, by projection name or group: ``"mamba"`` (Mamba2 ``in_proj``, ``out_proj``),
``"attention"`` (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``), ``"mlp"`` (``gate_up``,
``up``, ``down``: every MLP, a MoE's shared expert too). The gated MLPs' one ``gate_up``
weight ``[K, 2, F]`` gets a pair of adapters, gate and up (``lora_a[K, 2, r]``,
``lora_b[2, r, F]``; PEFT's ``gate_proj`` and ``up_proj``), or for Granite, whose
checkpoints fuse them in one ``input_linear``, one adapter (``lora_a[K, r]``). Routed
expert weights take no adapter here.

Train the adapters alone with ``make_optimizer(model, tx, trainable=nnx.LoRAParam)``;
``merge_lora`` folds them into the weights for serving; ``save_lora_adapter`` /
``load_lora_adapter`` write and read PEFT's adapter format (``adapter_config.json``,
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight [r, in]`` /
``lora_B.weight [out, r]``). Models built without a mesh (one device, or split for training
by ``flax_models.training.fsdp``): the layers of a model built on a mesh run per-device
copies of the plain projections and would skip the adapters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from flax_models.checkpoint import hf_name_to_module_path, module_path_to_hf_name
from flax_models.layers.linear import Einsum, Linear
from flax_models.model import HybridLM

GROUPS: dict[str, tuple[str, ...]] = {
    "mamba": ("in_proj", "out_proj"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_up", "up", "down"),
}
DEFAULT_TARGETS = ("mamba", "attention", "mlp")
_NAMES = {name for names in GROUPS.values() for name in names}
# Families whose gate and up are one HF linear (one adapter for both halves).
_FUSED_GATE_UP = ("granitemoehybrid",)


def _scale(module) -> float:
    return module.lora_alpha / module.lora_rank


class LoRALinear(Linear):
    """``Linear`` plus ``(alpha / r) · (x A) B``; ``lora_a[K, r]``, ``lora_b[r, N]``."""

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        y = super().__call__(inputs, out_sharding)
        a, b = self.lora_a[...], self.lora_b[...]
        low = jnp.dot(jnp.dot(inputs.astype(a.dtype), a), b) * _scale(self)
        return y + low.astype(y.dtype)

    def delta(self) -> jax.Array:
        """The kernel's low-rank update ``(alpha / r) A B``, [K, N]."""
        return jnp.dot(self.lora_a[...], self.lora_b[...]) * _scale(self)


class LoRAEinsum(Einsum):
    """The MLP's ``gate_up`` (``...d,dgf->...gf``) plus its adapters: gate and up apart
    (``lora_a[K, 2, r]``) or one for both (``lora_a[K, r]``); ``lora_b[2, r, F]``."""

    def __call__(self, inputs: jax.Array, einsum_str: str | None = None, out_sharding=None):
        y = super().__call__(inputs, einsum_str, out_sharding)
        a, b = self.lora_a[...], self.lora_b[...]
        x = inputs.astype(a.dtype)
        if a.ndim == 2:  # one adapter: x A [.., r], then each half's B
            low = jnp.einsum("...r,grf->...gf", jnp.dot(x, a), b)
        else:
            low = jnp.einsum("...gr,grf->...gf", jnp.einsum("...d,dgr->...gr", x, a), b)
        return y + (low * _scale(self)).astype(y.dtype)

    def delta(self) -> jax.Array:
        a, b = self.lora_a[...], self.lora_b[...]
        if a.ndim == 2:
            return jnp.einsum("dr,grf->dgf", a, b) * _scale(self)
        return jnp.einsum("dgr,grf->dgf", a, b) * _scale(self)


_LORA_CLASSES = {Linear: LoRALinear, Einsum: LoRAEinsum}
_BASE_CLASSES = {v: k for k, v in _LORA_CLASSES.items()}


def _target_names(targets: str | Iterable[str]) -> set[str]:
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    names = set()
    for target in targets:
        if target in GROUPS:
            names |= set(GROUPS[target])
        elif target in _NAMES:
            names.add(target)
        else:
            raise ValueError(
                f"LoRA target {target!r} must be one of {sorted(GROUPS)} or {sorted(_NAMES)}"
            )
    return names


def _projections(model: HybridLM):
    """(module path, module) of every projection that can take an adapter."""
    for path, module in nnx.iter_modules(model):
        named = path and str(path[-1]) in _NAMES and path[0] != "lm_head"
        if named and isinstance(module, Linear | Einsum):
            yield ".".join(map(str, path)), module


def _check_mesh(model: HybridLM) -> None:
    if model.mesh is not None:
        raise NotImplementedError(
            "LoRA on a model built on a mesh: its sharded layers run per-device copies of "
            "the plain projections (shard_call) and read their weights directly; add the "
            "adapters to a model without a mesh (FSDP places it: flax_models.training.fsdp)"
        )


def _attach(module, path: str, cfg, *, rank: int, alpha: float, dtype, key) -> None:
    kernel = module.kernel
    if isinstance(module, Einsum):  # gate_up [K, 2, F]
        K, _, F = kernel.shape
        shape_a = (K, rank) if cfg.family in _FUSED_GATE_UP else (K, 2, rank)
        shape_b = (2, rank, F)
    else:
        K, F = kernel.shape
        shape_a, shape_b = (K, rank), (rank, F)
    # PEFT's initialisation: A Kaiming-uniform (gain for a = √5: bound 1 / √K), B zero.
    bound = 1.0 / np.sqrt(K)
    module.lora_a = nnx.LoRAParam(jax.random.uniform(key, shape_a, dtype, -bound, bound))
    module.lora_b = nnx.LoRAParam(jnp.zeros(shape_b, dtype))
    module.lora_rank, module.lora_alpha = rank, float(alpha)
    module.__class__ = _LORA_CLASSES[type(module)]


def add_lora(
    model: HybridLM,
    *,
    rank: int,
    alpha: float,
    targets: str | Iterable[str] = DEFAULT_TARGETS,
    dtype: jnp.dtype = jnp.float32,
    rngs: nnx.Rngs | None = None,
) -> HybridLM:
    """Adds LoRA adapters of ``rank`` and scale ``alpha / rank`` to ``model``'s targeted
    projections, in place (returns the model). ``targets``: group or projection names
    (module docstring); ``dtype``: the adapters' (fp32 by default, whatever the weights').
    ``B = 0``: the model's outputs are unchanged until the adapters are trained.
    ``ValueError`` for an unknown target, a projection that already has one or no
    projection targeted."""
    _check_mesh(model)
    if rank < 1:
        raise ValueError(f"{rank=} must be >= 1")
    names = _target_names(targets)
    rngs = nnx.Rngs(0) if rngs is None else rngs
    found = [(p, m) for p, m in _projections(model) if p.rsplit(".", 1)[-1] in names]
    if not found:
        raise ValueError(f"no projection of this model is named by {targets=}")
    for path, module in found:
        if isinstance(module, LoRALinear | LoRAEinsum):
            raise ValueError(f"{path} already has a LoRA adapter")
        _attach(module, path, model.cfg, rank=rank, alpha=alpha, dtype=dtype, key=rngs.params())
    return model


def _adapted(model: HybridLM):
    return [(p, m) for p, m in _projections(model) if isinstance(m, LoRALinear | LoRAEinsum)]


def merge_lora(model: HybridLM) -> HybridLM:
    """Folds every adapter into its weight (``W + (alpha / r) A B``, in the weight's dtype)
    and removes it, in place: the model is a plain ``HybridLM`` again (the structure a
    fresh one has, for serving, ``save_hf_checkpoint`` or ``Engine.update_weights``)."""
    for _, module in _adapted(model):
        kernel = module.kernel[...]
        module.kernel[...] = (kernel.astype(jnp.float32) + module.delta()).astype(kernel.dtype)
        del module.lora_a, module.lora_b, module.lora_rank, module.lora_alpha
        module.__class__ = _BASE_CLASSES[type(module)]
    return model


# ------------------------------------------------------------------------ PEFT files

_PREFIX = "base_model.model."


def _peft_tensors(model: HybridLM, path: str, module) -> dict[str, np.ndarray]:
    """One projection's adapter under PEFT's names, [r, in] and [out, r]."""
    a, b = np.asarray(module.lora_a[...]), np.asarray(module.lora_b[...])
    base = module_path_to_hf_name(model.cfg, f"{path}.kernel").removesuffix(".weight")
    if isinstance(module, LoRALinear):
        return {f"{base}.lora_A.weight": a.T, f"{base}.lora_B.weight": b.T}
    if a.ndim == 2:  # one fused gate|up linear [2I, K]: B stacks the halves' rows
        return {
            f"{base}.lora_A.weight": a.T,
            f"{base}.lora_B.weight": np.concatenate(b.transpose(0, 2, 1)),
        }
    stem = base.removesuffix(".gate_up_proj")
    return {
        f"{stem}.{half}_proj.lora_{ab}.weight": value
        for g, half in enumerate(("gate", "up"))
        for ab, value in (("A", a[:, g].T), ("B", b[g].T))
    }


def save_lora_adapter(
    model: HybridLM, directory: str | Path, *, base_model_name_or_path: str | None = None
) -> Path:
    """Writes the model's adapters as a PEFT LoRA adapter: ``adapter_config.json`` (``r``,
    ``lora_alpha``, ``target_modules``, ``peft_type: "LORA"``, ``base_model_name_or_path``
    (default the config's ``_name_or_path``), ...) and ``adapter_model.safetensors``
    (``base_model.model.<HF module>.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r], the
    adapters' dtype). ``ValueError`` when the model has none, or adapters of several ranks
    or alphas."""
    adapted = _adapted(model)
    if not adapted:
        raise ValueError("the model has no LoRA adapter (add_lora)")
    settings = {(m.lora_rank, m.lora_alpha) for _, m in adapted}
    if len(settings) > 1:
        raise ValueError(f"adapters of several (rank, alpha): {sorted(settings)}")
    ((rank, alpha),) = settings
    tensors = {}
    for path, module in adapted:
        tensors |= {
            _PREFIX + k: np.ascontiguousarray(v)
            for k, v in _peft_tensors(model, path, module).items()
        }
    modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
    if base_model_name_or_path is None:
        base_model_name_or_path = (model.cfg.hf_config or {}).get("_name_or_path")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path,
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    safetensors.numpy.save_file(tensors, directory / "adapter_model.safetensors", {"format": "pt"})
    return directory


_PEFT_NAME = re.compile(r"^base_model\.model\.(.*)\.lora_([AB])\.weight$")
_HALF = re.compile(r"^(.*)\.(gate|up)_proj$")


def load_lora_adapter(model: HybridLM, directory: str | Path) -> HybridLM:
    """Reads a PEFT LoRA adapter (as :func:`save_lora_adapter` writes it) into ``model``, in
    place: projections without an adapter get one of the file's rank and alpha first.
    ``ValueError`` naming every tensor that matches no projection or has the wrong shape,
    and for options this module does not implement (DoRA, rsLoRA, per-module ranks)."""
    _check_mesh(model)
    directory = Path(directory)
    config = json.loads((directory / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"peft_type={config.get('peft_type')!r} is not 'LORA'")
    for option in ("use_dora", "use_rslora"):
        if config.get(option):
            raise ValueError(f"{option}=True is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(
            "per-module ranks or alphas (rank_pattern, alpha_pattern) are not supported"
        )
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    found: dict[str, dict[str, np.ndarray]] = {}  # module path → {"A"/"B" (+ half)}
    errors = []
    for name, tensor in safetensors.numpy.load_file(
        directory / "adapter_model.safetensors"
    ).items():
        match = _PEFT_NAME.match(name)
        if match is None:
            errors.append(f"unexpected tensor {name}")
            continue
        hf_module, ab = match[1], match[2]
        half = _HALF.match(hf_module)
        key = ab
        if half is not None:  # gate_proj / up_proj: the halves of the model's gate_up
            hf_module, key = f"{half[1]}.gate_up_proj", f"{ab}{half[2]}"
        target = hf_name_to_module_path(model.cfg.family, f"{hf_module}.weight")
        if target is None or not target.endswith(".kernel"):
            errors.append(f"tensor {name} names no projection")
            continue
        found.setdefault(target.removesuffix(".kernel"), {})[key] = tensor
    modules = dict(_projections(model))
    rngs = nnx.Rngs(0)
    for path, parts in sorted(found.items()):
        module = modules.get(path)
        if module is None:
            errors.append(f"adapter for {path}: the model has no such projection")
            continue
        if not isinstance(module, LoRALinear | LoRAEinsum):
            _attach(
                module,
                path,
                model.cfg,
                rank=rank,
                alpha=alpha,
                dtype=jnp.float32,
                key=rngs.params(),
            )
        a, b = _from_peft(module, parts)
        for var, value, label in ((module.lora_a, a, "lora_A"), (module.lora_b, b, "lora_B")):
            if value is None or value.shape != var.shape:
                errors.append(
                    f"{path} {label}: got {None if value is None else value.shape}, "
                    f"needs {var.shape}"
                )
            else:
                var[...] = jnp.asarray(value, var.dtype)
        module.lora_rank, module.lora_alpha = rank, alpha
    if errors:
        raise ValueError(
            f"adapter {directory} does not fit the model ({len(errors)} problems):\n  "
            + "\n  ".join(errors)
        )
    return model


def _from_peft(module, parts: dict[str, np.ndarray]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """PEFT's [r, in] / [out, r] tensors → ``lora_a`` / ``lora_b`` of ``module``'s layout."""
    if isinstance(module, LoRALinear):
        a, b = parts.get("A"), parts.get("B")
        return (None if a is None else a.T), (None if b is None else b.T)
    if "A" in parts or "B" in parts:  # one fused adapter; B [2I, r] → [2, r, I]
        a, b = parts.get("A"), parts.get("B")
        b = None if b is None else b.reshape(2, -1, b.shape[-1]).transpose(0, 2, 1)
        return (None if a is None else a.T), b
    try:
        a = np.stack([parts["Agate"].T, parts["Aup"].T], axis=1)  # [K, 2, r]
        b = np.stack([parts["Bgate"].T, parts["Bup"].T])  # [2, r, I]
    except KeyError:
        return None, None
    return a, b
