"""Function-preserving widening of a small trained model (benchmark workloads).

A benchmark of speculative decoding needs two things at once: a target whose weights do
not fit in cache (so decode is memory-bound, as on a GPU) and a target whose outputs a
draft can predict (a trained model). Training a 100M+ model is out of reach on 2 CPU cores,
so the benchmarks take a small model trained on the demo task and embed it in a wider one:

* hidden H -> H' = r H: every activation is [x, 0]; RMSNorm over H' sees mean(x^2) / r, so
  norm weights are divided by sqrt(r) and eps by r: sqrt(m / r + eps / r) = sqrt(m + eps) / sqrt(r),
  the normalised values are unchanged (the per-head q/k norms see the eps change only, a
  relative 1e-6 effect on activations of order 1);
* extra attention heads (same head_dim) and extra MLP units have zero weights: their
  outputs are exactly zero;
* the EAGLE-3 head is widened the same way (fc, both halves of the 2H attention input).

Zero weights cost the same as any others in dense kernels: the widened model reads and
multiplies all of its parameters on every forward. It computes (to float rounding) what the
small model computes, so drafts are accepted as often as on the small pair.
"""

from __future__ import annotations

import json
import math
import os

import torch

from megatron_spec.models import HFCheckpoint, save_hf_checkpoint


def _norm(w: torch.Tensor, big: int, r: float) -> torch.Tensor:
    out = torch.zeros(big, dtype=w.dtype)
    out[: w.numel()] = w / math.sqrt(r)
    return out


def _block(w: torch.Tensor, rows: int, cols: int, row_map, col_map) -> torch.Tensor:
    """Place ``w`` into a zero ``[rows, cols]`` matrix: w's row block i goes to row offset row_map(i)."""
    out = torch.zeros(rows, cols, dtype=w.dtype)
    for (r0, r1, R0), (c0, c1, C0) in ((a, b) for a in row_map for b in col_map):
        out[R0:R0 + (r1 - r0), C0:C0 + (c1 - c0)] = w[r0:r1, c0:c1]
    return out


def expand_decoder(
    small_dir: str, out_dir: str, *, hidden: int, heads: int, kv_heads: int, intermediate: int
) -> str:
    ck = HFCheckpoint(small_dir)
    c = ck.decoder_config
    d = c.head_dim
    if (
        heads * d != hidden
        or heads % kv_heads
        or heads // kv_heads != c.num_attention_heads // c.num_kv_heads
    ):
        raise ValueError("widened model must keep head_dim and the query-group size")
    r = hidden / c.hidden_size
    h = c.hidden_size
    t = {}
    cols_h = [(0, h, 0)]
    t["model.embed_tokens.weight"] = _block(ck.get("model.embed_tokens.weight"), c.vocab_size, hidden,
                                            [(0, c.vocab_size, 0)], cols_h)
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = _block(
            ck.get("lm_head.weight"), c.vocab_size, hidden, [(0, c.vocab_size, 0)], cols_h
        )
    t["model.norm.weight"] = _norm(ck.get("model.norm.weight"), hidden, r)
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}.{n}.weight"] = _norm(ck.get(f"{p}.{n}.weight"), hidden, r)
        t[f"{p}.self_attn.q_proj.weight"] = _block(ck.get(f"{p}.self_attn.q_proj.weight"), heads * d, hidden,
                                                   [(0, c.q_size, 0)], cols_h)
        for n in ("k", "v"):
            t[f"{p}.self_attn.{n}_proj.weight"] = _block(
                ck.get(f"{p}.self_attn.{n}_proj.weight"), kv_heads * d, hidden, [(0, c.kv_size, 0)], cols_h
            )
        t[f"{p}.self_attn.o_proj.weight"] = _block(ck.get(f"{p}.self_attn.o_proj.weight"), hidden, heads * d,
                                                   [(0, h, 0)], [(0, c.q_size, 0)])
        if c.qk_norm:
            for n in ("q_norm", "k_norm"):
                t[f"{p}.self_attn.{n}.weight"] = ck.get(f"{p}.self_attn.{n}.weight").clone()
        if c.qkv_bias:
            raise ValueError("widening models with q/k/v biases is not implemented")
        for n in ("gate", "up"):
            t[f"{p}.mlp.{n}_proj.weight"] = _block(ck.get(f"{p}.mlp.{n}_proj.weight"), intermediate, hidden,
                                                   [(0, c.intermediate_size, 0)], cols_h)
        t[f"{p}.mlp.down_proj.weight"] = _block(ck.get(f"{p}.mlp.down_proj.weight"), hidden, intermediate,
                                                [(0, h, 0)], [(0, c.intermediate_size, 0)])
    cfg = dict(ck.config_dict, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
               intermediate_size=intermediate, head_dim=d, rms_norm_eps=c.rms_norm_eps / r)
    save_hf_checkpoint(out_dir, t, cfg, copy_files_from=small_dir)
    return out_dir


def expand_eagle3(
    small_dir: str, out_dir: str, *, hidden: int, heads: int, kv_heads: int, intermediate: int
) -> str:
    from safetensors.torch import load_file, save_file

    with open(os.path.join(small_dir, "config.json")) as f:
        cfg = json.load(f)
    src = load_file(os.path.join(small_dir, "model.safetensors"))
    src = {k.replace("midlayer.", "layers.0."): v for k, v in src.items()}
    h = cfg["hidden_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    r = hidden / h
    q_small, kv_small = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    n_aux = src["fc.weight"].shape[1] // h
    t = {}
    t["fc.weight"] = _block(src["fc.weight"], hidden, n_aux * hidden, [(0, h, 0)],
                            [(i * h, (i + 1) * h, i * hidden) for i in range(n_aux)])
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"layers.0.{n}.weight"] = _norm(src[f"layers.0.{n}.weight"], hidden, r)
    t["norm.weight"] = _norm(src["norm.weight"], hidden, r)
    two_h = [(0, h, 0), (h, 2 * h, hidden)]  # [embedding half, hidden half] of the 2H input
    t["layers.0.self_attn.q_proj.weight"] = _block(
        src["layers.0.self_attn.q_proj.weight"], heads * d, 2 * hidden, [(0, q_small, 0)], two_h
    )
    for n in ("k", "v"):
        t[f"layers.0.self_attn.{n}_proj.weight"] = _block(
            src[f"layers.0.self_attn.{n}_proj.weight"], kv_heads * d, 2 * hidden, [(0, kv_small, 0)], two_h
        )
    t["layers.0.self_attn.o_proj.weight"] = _block(src["layers.0.self_attn.o_proj.weight"], hidden, heads * d,
                                                   [(0, h, 0)], [(0, q_small, 0)])
    inter_small = src["layers.0.mlp.gate_proj.weight"].shape[0]
    for n in ("gate", "up"):
        t[f"layers.0.mlp.{n}_proj.weight"] = _block(
            src[f"layers.0.mlp.{n}_proj.weight"], intermediate, hidden, [(0, inter_small, 0)], [(0, h, 0)]
        )
    t["layers.0.mlp.down_proj.weight"] = _block(src["layers.0.mlp.down_proj.weight"], hidden, intermediate,
                                                [(0, h, 0)], [(0, inter_small, 0)])
    t["lm_head.weight"] = _block(src["lm_head.weight"], src["lm_head.weight"].shape[0], hidden,
                                 [(0, src["lm_head.weight"].shape[0], 0)], [(0, h, 0)])
    if "d2t" in src:
        t["d2t"] = src["d2t"]
    cfg.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
               intermediate_size=intermediate, head_dim=d, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6) / r)
    tmp = out_dir + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(tmp, out_dir)
    return out_dir
