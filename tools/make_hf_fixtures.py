"""Build tiny random Hugging Face reference models and golden logits for the parity tests.

For every family (mamba2, bamba, granitemoehybrid, granitemoehybrid_nope, nemotronh) this
builds a tiny float32 model from a config with `transformers`, deterministically (fixed torch
seeds), re-randomizes every parameter whose library initial value is trivial (A_log, D,
dt_bias, all RMSNorm weights incl. the Mamba gated norm, conv1d bias; also all other weights,
so that every term of the forward contributes well above float32 noise), and writes

    <out_dir>/<family>/config.json         (save_pretrained)
    <out_dir>/<family>/model.safetensors   (save_pretrained, float32)
    <out_dir>/<family>/golden.npz          input_ids int32 [2, L], logits float32 [2, L, V],
                                           family, transformers_version, torch_version (str)

The logits come from the model's eval-mode forward with use_cache=False, eager attention, on
CPU with transformers' pure-torch fallbacks (no mamba_ssm / causal_conv1d installed), so the
Mamba2 layers run `mamba2_chunk_scan` (chunked SSD) in float32. L is chosen not to be a
multiple of the chunk size. The script reloads every saved directory with `from_pretrained`
and checks it reproduces the golden logits.

This is a developer tool; it is not run by the test suite (the fixtures are committed). It
needs torch and transformers, which the project itself does not depend on. How to run, from
the repository root (a venv outside the repo, Python 3.11, CPU torch):

    /root/.pyenv/versions/3.11.7/bin/python -m venv /root/hfenv
    /root/hfenv/bin/pip install torch==2.13.0          # must resolve to 2.13.0+cpu, no CUDA
    /root/hfenv/bin/pip install transformers==5.23.0 safetensors numpy
    /root/hfenv/bin/python tools/make_hf_fixtures.py tests/fixtures

Optional: `--only FAMILY [FAMILY ...]` to rebuild a subset.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys

import numpy as np
import safetensors.numpy
import torch
import transformers
from safetensors import safe_open
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
)

BATCH = 2


def _mamba2():
    # all-Mamba2; tied embeddings; n_groups=2; chunk 8; L=37 (4 full chunks + 5).
    config = Mamba2Config(
        vocab_size=160,
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=16,
        head_dim=8,
        expand=2,
        state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        use_bias=False,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        residual_in_fp32=True,
        time_step_limit=(0.0, float("inf")),
        tie_word_embeddings=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    return Mamba2ForCausalLM, config, 37


def _bamba():
    # layers [mamba, attention, mamba]; GQA 4/2 heads of 16; partial RoPE 0.5 (8 of 16 dims);
    # n_groups=1; chunk 16; L=21; untied; non-trivial time_step_limit so both clamps bite.
    config = BambaConfig(
        vocab_size=192,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        time_step_limit=(0.01, 0.5),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return BambaForCausalLM, config, 21


def _granite(position_embedding_type: str, layer_types: list[str]):
    # dense (num_local_experts=0 -> shared_mlp only); Granite-4.0-H-like multipliers; GQA 4/2;
    # n_groups=2; chunk 8; tied embeddings.
    return GraniteMoeHybridConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,  # only used by routed experts; unused here
        shared_intermediate_size=96,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        position_embedding_type=position_embedding_type,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
        num_local_experts=0,
        num_experts_per_tok=0,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=8,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        time_step_limit=(0.0, float("inf")),
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _granitemoehybrid():
    config = _granite("rope", ["mamba", "attention", "mamba"])
    return GraniteMoeHybridForCausalLM, config, 37


def _granitemoehybrid_nope():
    config = _granite("nope", ["mamba", "attention"])
    return GraniteMoeHybridForCausalLM, config, 21


def _nemotronh():
    # pattern M * M - ; relu2 MLP; attention without RoPE, GQA 4/2, head_dim 16;
    # mamba intermediate = mamba_num_heads * mamba_head_dim = 96 != expand * hidden (128), as in
    # Nemotron-H-9B-v2; dt clamp is (time_step_min, inf) -> time_step_min chosen so it bites.
    config = NemotronHConfig(
        vocab_size=128,
        hidden_size=64,
        hybrid_override_pattern="M*M-",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        attention_bias=False,
        intermediate_size=128,
        mlp_hidden_act="relu2",
        mlp_bias=False,
        ssm_state_size=16,
        mamba_num_heads=12,
        mamba_head_dim=8,
        mamba_hidden_act="silu",
        n_groups=2,
        conv_kernel=4,
        expand=2,
        chunk_size=16,
        use_conv_bias=True,
        mamba_proj_bias=False,
        use_bias=False,
        time_step_min=0.02,
        time_step_max=0.1,
        layer_norm_epsilon=1e-5,
        residual_in_fp32=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return NemotronHForCausalLM, config, 37


FAMILIES = {
    "mamba2": (_mamba2, 1001),
    "bamba": (_bamba, 1002),
    "granitemoehybrid": (_granitemoehybrid, 1003),
    "granitemoehybrid_nope": (_granitemoehybrid_nope, 1004),
    "nemotronh": (_nemotronh, 1005),
}


@torch.no_grad()
def rerandomize(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded random values of a sensible scale.

    The library's initial values (A_log = log(1..n), D = 1, dt_bias = 1 or inv_softplus(dt),
    norm weights = 1, conv bias = 0, padding row = 0, std-0.02 linears) hide mapping errors
    or make whole terms negligible, so every parameter is redrawn here:
      A_log ~ U(-1, 2)            (A = -exp(A_log) in [-7.4, -0.37])
      D ~ U(-0.5, 1.5)
      dt_bias ~ U(-4.5, 1.0)      (softplus in ~[0.011, 1.31])
      any norm weight ~ U(0.5, 1.5)  (RMSNorm weights and the Mamba gated norm)
      conv1d.bias ~ U(-0.5, 0.5);  conv1d.weight ~ U(-0.5, 0.5)
      embeddings ~ N(0, 0.5^2)
      other 2D weights (Linear [out, in]) ~ N(0, 1 / in)
      other 1D (biases, none in these configs) ~ U(-0.2, 0.2)
    Tied parameters are visited once (named_parameters dedups them).
    """
    gen = torch.Generator().manual_seed(seed)

    def uniform(p, lo, hi):
        p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float32) * (hi - lo) + lo)

    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            uniform(p, -1.0, 2.0)
        elif leaf == "D":
            uniform(p, -0.5, 1.5)
        elif leaf == "dt_bias":
            uniform(p, -4.5, 1.0)
        elif "norm" in name and leaf == "weight":
            uniform(p, 0.5, 1.5)
        elif "conv1d" in name:
            uniform(p, -0.5, 0.5)
        elif "embed" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif p.ndim == 2:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        else:
            uniform(p, -0.2, 0.2)


def dt_clamp_report(model, input_ids) -> str:
    """How often dt = softplus(in_proj dt part + dt_bias) falls outside the clamp (diagnostic)."""
    lines = []
    hooks = []
    captured = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "dt_bias") and hasattr(mod, "in_proj"):

            def hook(_lin, args, out, name=name, mixer=mod):
                captured[name] = (mixer, out.detach())

            hooks.append(mod.in_proj.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=False)
    for h in hooks:
        h.remove()
    for name, (m, proj) in captured.items():
        dt = torch.nn.functional.softplus(proj[..., -m.num_heads :] + m.dt_bias)
        lo, hi = m.time_step_limit
        lines.append(
            f"    {name}: dt in [{dt.min():.4f}, {dt.max():.4f}], limit ({lo}, {hi}): "
            f"{(dt < lo).float().mean():.2%} below, {(dt > hi).float().mean():.2%} above"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Independent float64 numpy reference (sequential SSM recurrence, no chunking), reading only the
# saved config.json + model.safetensors. build() asserts it matches the torch golden logits, so
# the fixtures are known to encode exactly this math, which is what the JAX models must implement.
# ---------------------------------------------------------------------------------------------


def _json_float(v) -> float:
    # transformers 5 writes float("inf") in config.json as {"__float__": "Infinity"}.
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _ref_mamba2(x, W, pre, nh, hd, N, G, K, eps, dt_lo, dt_hi):
    bsz, L, _ = x.shape
    di = nh * hd
    # in_proj output = [z (di) | xBC (di + 2*G*N) | dt (nh)]
    z, xbc, dt = np.split(x @ W[pre + "in_proj.weight"].T, [di, 2 * di + 2 * G * N], axis=-1)
    cw = W[pre + "conv1d.weight"][:, 0, :]  # [conv_dim, K], causal depthwise, left zero pad K-1
    padded = np.concatenate([np.zeros((bsz, K - 1, xbc.shape[-1])), xbc], axis=1)
    conv = sum(padded[:, k : k + L, :] * cw[:, k] for k in range(K))
    if pre + "conv1d.bias" in W:
        conv = conv + W[pre + "conv1d.bias"]
    xbc = _silu(conv)
    xs, Bm, Cm = np.split(xbc, [di, di + G * N], axis=-1)
    xs = xs.reshape(bsz, L, nh, hd)
    Bm = Bm.reshape(bsz, L, G, N)
    Cm = Cm.reshape(bsz, L, G, N)
    dt = np.clip(np.logaddexp(0.0, dt + W[pre + "dt_bias"]), dt_lo, dt_hi)  # [B, L, nh]
    A = -np.exp(W[pre + "A_log"])
    D = W[pre + "D"]
    grp = np.arange(nh) // (nh // G)  # head h reads B/C group h // (nh / G)
    h = np.zeros((bsz, nh, hd, N))
    y = np.zeros((bsz, L, nh, hd))
    for t in range(L):
        Bt, Ct = Bm[:, t][:, grp], Cm[:, t][:, grp]  # [B, nh, N]
        h = h * np.exp(dt[:, t] * A)[:, :, None, None]
        h = h + (dt[:, t, :, None] * xs[:, t])[..., None] * Bt[:, :, None, :]
        y[:, t] = np.einsum("bhpn,bhn->bhp", h, Ct) + D[:, None] * xs[:, t]
    y = y.reshape(bsz, L, di) * _silu(z)  # gate first, then grouped RMS norm
    yg = y.reshape(bsz, L, G, di // G)
    yg = yg / np.sqrt((yg * yg).mean(-1, keepdims=True) + eps)
    y = yg.reshape(bsz, L, di) * W[pre + "norm.weight"]
    return y @ W[pre + "out_proj.weight"].T


def _ref_attention(x, W, pre, nh, nkv, hd, scaling, rope_theta, rotary_fraction):
    bsz, L, _ = x.shape
    q = (x @ W[pre + "q_proj.weight"].T).reshape(bsz, L, nh, hd)
    k = (x @ W[pre + "k_proj.weight"].T).reshape(bsz, L, nkv, hd)
    v = (x @ W[pre + "v_proj.weight"].T).reshape(bsz, L, nkv, hd)
    if rope_theta is not None:  # rotate-half RoPE on the first rd dims of each head
        rd = int(hd * rotary_fraction)
        ang = np.arange(L)[:, None] * (1.0 / rope_theta ** (np.arange(0, rd, 2) / rd))[None]
        cos = np.cos(np.concatenate([ang, ang], -1))[None, :, None]
        sin = np.sin(np.concatenate([ang, ang], -1))[None, :, None]

        def rope(t):
            r, rest = t[..., :rd], t[..., rd:]
            half = np.concatenate([-r[..., rd // 2 :], r[..., : rd // 2]], -1)
            return np.concatenate([r * cos + half * sin, rest], -1)

        q, k = rope(q), rope(k)
    kv_of = np.arange(nh) // (nh // nkv)  # GQA: query head h reads kv head h // (nh / nkv)
    s = np.einsum("bqhd,bkhd->bhqk", q, k[:, :, kv_of]) * scaling
    s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s = s / s.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", s, v[:, :, kv_of]).reshape(bsz, L, nh * hd)
    return o @ W[pre + "o_proj.weight"].T


def numpy_reference_logits(fdir: str, input_ids: np.ndarray) -> np.ndarray:
    with open(os.path.join(fdir, "config.json")) as fh:
        cfg = json.load(fh)
    raw = safetensors.numpy.load_file(os.path.join(fdir, "model.safetensors"))
    W = {k: v.astype(np.float64) for k, v in raw.items()}
    mt = cfg["model_type"]
    ids = np.asarray(input_ids)

    if mt == "mamba2":
        eps = cfg["layer_norm_epsilon"]
        lo, hi = (_json_float(v) for v in cfg["time_step_limit"])
        emb = W["backbone.embeddings.weight"]
        h = emb[ids]
        for i in range(cfg["num_hidden_layers"]):
            p = f"backbone.layers.{i}."
            x = _rms(h, W[p + "norm.weight"], eps)
            h = h + _ref_mamba2(
                x,
                W,
                p + "mixer.",
                cfg["num_heads"],
                cfg["head_dim"],
                cfg["state_size"],
                cfg["n_groups"],
                cfg["conv_kernel"],
                eps,
                lo,
                hi,
            )
        h = _rms(h, W["backbone.norm_f.weight"], eps)
        return h @ (emb if cfg["tie_word_embeddings"] else W["lm_head.weight"]).T

    if mt in ("bamba", "granitemoehybrid"):
        eps = cfg["rms_norm_eps"]
        lo, hi = (_json_float(v) for v in cfg["time_step_limit"])
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg["hidden_size"] // nh
        rope = cfg["rope_parameters"]
        if mt == "bamba":
            attn_idx = cfg["attn_layer_indices"] or []
            kinds = ["attn" if i in attn_idx else "mamba" for i in range(cfg["num_hidden_layers"])]
            emb_mult = res_mult = logits_div = 1.0
            scaling = hd**-0.5
            theta, frac = rope["rope_theta"], rope.get("partial_rotary_factor", 1.0)
            post_norm, final_norm = "pre_ff_layernorm", "model.final_layernorm.weight"
        else:
            mamba_names = ("mamba", "linear_attention")  # hub configs use "mamba"/"attention"
            kinds = ["mamba" if t in mamba_names else "attn" for t in cfg["layer_types"]]
            emb_mult = cfg["embedding_multiplier"]
            res_mult = cfg["residual_multiplier"]
            logits_div = cfg["logits_scaling"]
            scaling = cfg["attention_multiplier"]
            theta = rope["rope_theta"] if cfg["position_embedding_type"] == "rope" else None
            frac = 1.0
            post_norm, final_norm = "post_attention_layernorm", "model.norm.weight"
        emb = W["model.embed_tokens.weight"]
        h = emb[ids] * emb_mult
        for i, kind in enumerate(kinds):
            p = f"model.layers.{i}."
            x = _rms(h, W[p + "input_layernorm.weight"], eps)
            if kind == "mamba":
                x = _ref_mamba2(
                    x,
                    W,
                    p + "mamba.",
                    cfg["mamba_n_heads"],
                    cfg["mamba_d_head"],
                    cfg["mamba_d_state"],
                    cfg["mamba_n_groups"],
                    cfg["mamba_d_conv"],
                    eps,
                    lo,
                    hi,
                )
            else:
                x = _ref_attention(x, W, p + "self_attn.", nh, nkv, hd, scaling, theta, frac)
            h = h + x * res_mult
            x = _rms(h, W[p + post_norm + ".weight"], eps)
            if mt == "bamba":
                f = p + "feed_forward."
                x = _silu(x @ W[f + "gate_proj.weight"].T) * (x @ W[f + "up_proj.weight"].T)
                x = x @ W[f + "down_proj.weight"].T
            else:
                f = p + "shared_mlp."
                gate, up = np.split(x @ W[f + "input_linear.weight"].T, 2, axis=-1)
                x = (_silu(gate) * up) @ W[f + "output_linear.weight"].T
            h = h + x * res_mult
        h = _rms(h, W[final_norm], eps)
        lm = emb if cfg["tie_word_embeddings"] else W["lm_head.weight"]
        return (h @ lm.T) / logits_div

    if mt == "nemotron_h":
        eps = cfg["layer_norm_epsilon"]
        kinds = cfg.get("layers_block_type")
        if kinds is None:  # hub configs: "hybrid_override_pattern": "M-M*-..."
            table = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
            kinds = [table[c] for c in cfg["hybrid_override_pattern"]]
        emb = W["backbone.embeddings.weight"]
        h = emb[ids]
        for i, kind in enumerate(kinds):
            p = f"backbone.layers.{i}."
            m = p + "mixer."
            x = _rms(h, W[p + "norm.weight"], eps)
            if kind == "linear_attention":
                x = _ref_mamba2(
                    x,
                    W,
                    m,
                    cfg["mamba_num_heads"],
                    cfg["mamba_head_dim"],
                    cfg["ssm_state_size"],
                    cfg["n_groups"],
                    cfg["conv_kernel"],
                    eps,
                    cfg["time_step_min"],
                    math.inf,
                )
            elif kind == "full_attention":
                hd = cfg["head_dim"]
                nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
                x = _ref_attention(x, W, m, nh, nkv, hd, hd**-0.5, None, 1.0)
            elif kind == "mlp":
                x = np.maximum(x @ W[m + "up_proj.weight"].T, 0.0) ** 2  # relu2
                x = x @ W[m + "down_proj.weight"].T
            else:
                raise NotImplementedError(kind)
            h = h + x
        h = _rms(h, W["backbone.norm_f.weight"], eps)
        return h @ (emb if cfg["tie_word_embeddings"] else W["lm_head.weight"]).T

    raise NotImplementedError(mt)


def build(family: str, out_dir: str) -> None:
    make, seed = FAMILIES[family]
    model_cls, config, seq_len = make()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    torch.manual_seed(seed + 500)
    rerandomize(model, seed + 500)

    gen = torch.Generator().manual_seed(seed + 900)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, seq_len), generator=gen)
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits.float()
    assert logits.shape == (BATCH, seq_len, config.vocab_size), logits.shape
    assert torch.isfinite(logits).all()

    fdir = os.path.join(out_dir, family)
    if os.path.isdir(fdir):
        shutil.rmtree(fdir)
    # safetensors is the only format transformers 5 writes (no safe_serialization kwarg).
    model.save_pretrained(fdir)
    gen_cfg = os.path.join(fdir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    np.savez(
        os.path.join(fdir, "golden.npz"),
        input_ids=input_ids.numpy().astype(np.int32),
        logits=logits.numpy().astype(np.float32),
        family=np.array(family),
        transformers_version=np.array(transformers.__version__),
        torch_version=np.array(torch.__version__),
    )

    # Round trip: the saved directory alone reproduces the golden logits.
    reloaded = model_cls.from_pretrained(fdir, attn_implementation="eager", dtype=torch.float32)
    reloaded.eval()
    with torch.no_grad():
        logits2 = reloaded(input_ids=input_ids, use_cache=False).logits.float()
    err = (logits2 - logits).abs().max().item()
    assert err == 0.0, f"{family}: reload mismatch {err}"

    # Independent check: float64 numpy forward from the saved files matches the golden logits.
    ref = numpy_reference_logits(fdir, input_ids.numpy())
    ref_err = float(np.abs(ref - logits.numpy()).max())
    assert ref_err <= 1e-4 * max(1.0, float(np.abs(ref).max())), f"{family}: ref err {ref_err}"

    size = sum(os.path.getsize(os.path.join(fdir, f)) for f in os.listdir(fdir))
    assert size < 1_000_000, f"{family}: fixture too large ({size} bytes)"
    with safe_open(os.path.join(fdir, "model.safetensors"), "pt") as f:
        n_tensors = len(list(f.keys()))
    chunk = getattr(config, "chunk_size", None) or getattr(config, "mamba_chunk_size", None)
    print(
        f"{family}: {fdir} {size / 1024:.1f} KiB, {n_tensors} tensors, L={seq_len} "
        f"(chunk {chunk}), V={config.vocab_size}, logits std {logits.std():.3f}, "
        f"max|logit| {logits.abs().max():.3f}, max|numpy64 ref - golden| {ref_err:.1e}"
    )
    print(dt_clamp_report(model, input_ids))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="e.g. tests/fixtures")
    parser.add_argument("--only", nargs="+", choices=sorted(FAMILIES), default=None)
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        print("note: CUDA is visible but unused; everything runs on CPU", file=sys.stderr)
    torch.set_num_threads(1)  # bitwise-reproducible CPU reductions
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    os.makedirs(args.out_dir, exist_ok=True)
    for family in args.only or list(FAMILIES):
        build(family, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
