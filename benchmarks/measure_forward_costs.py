"""Measure what the simulator assumes: the seconds of a verify forward and of an EAGLE-3 draft pass.

    python benchmarks/measure_forward_costs.py --device cuda --out forward_costs.json
    python benchmarks/measure_forward_costs.py --device cpu --quick --out /tmp/costs.json   # dry run

For real model shapes (``--models``, names of ``megatron_spec.sim.models``: their real widths, heads and
vocabularies) with random bf16 weights, the native engine's own target model (``CausalLM``, over its slot
KV cache) runs one decode-time forward of B rows x (k+1) tokens at a context of ``--ctx`` cached tokens per
row, for B in ``--batch`` and k in ``--k`` (k = 0 is plain decoding), and its EAGLE-3 head one draft pass
of B rows x 1 token and one extend of B rows x (k+1). A model is built with as few layers as fit the time
(``--layers``, two depths): the full depth's time is the line through the two, ``t(L) = a + b L``
(everything outside the layers, embedding and the vocabulary's head, is ``a``). Times are medians of
``--reps`` runs after ``--warmup`` (CUDA events on a GPU, the host clock on a CPU).

The JSON (``--out``) is what ``megatron-spec simulate`` reads as measured calibration points
(``megatron_spec/sim/measured.py``): commit a GPU run's file as
``megatron_spec/sim/data/measured_forwards.json``. It knows nothing about RL or the simulator's formulas.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

DEFAULT_MODELS = ("llama-3.2-1b", "qwen3-8b")
DEFAULT_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_K = tuple(range(8))


def decoder_config(name: str, num_layers: int):
    """The simulator's config of ``name`` as the engine's :class:`DecoderConfig`, cut to ``num_layers``."""
    from megatron_spec.models.hf_config import DecoderConfig

    hf = dict(builtin_config(name), num_hidden_layers=num_layers)
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[
        hf["model_type"]
    ]
    hf.setdefault("architectures", [arch])
    hf.setdefault("rms_norm_eps", 1e-6)
    hf.setdefault("rope_theta", 1000000.0)
    hf.setdefault("max_position_embeddings", 40960)
    return DecoderConfig.from_hf_dict(hf, source=f"megatron_spec.sim.models {name}")


def builtin_config(name: str) -> dict:
    """The HF config dict the simulator holds for ``name`` (its real widths)."""
    from megatron_spec.sim import models

    if name not in models._BUILTIN_CONFIGS:
        raise SystemExit(f"unknown model {name!r}; one of {sorted(models._BUILTIN_CONFIGS)}")
    return models._BUILTIN_CONFIGS[name]


class Timer:
    """Median seconds of a callable: CUDA events on a GPU (device time of the queued work), else the host
    clock."""

    def __init__(self, device: torch.device, warmup: int, reps: int):
        self.device, self.warmup, self.reps = device, warmup, reps

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def measure_depth(name: str, layers: int, args, device: torch.device, timer: Timer) -> dict:
    """Seconds per verify forward ``{k: {B: s}}`` and per EAGLE-3 pass, at one depth."""
    from megatron_spec.draft.eagle3 import Eagle3Head
    from megatron_spec.draft.eagle3_config import Eagle3Config
    from megatron_spec.rollout.native.model import CausalLM

    dtype = getattr(torch, args.dtype)
    cfg = decoder_config(name, layers)
    b_max, k_max = max(args.batch), max(args.k)
    max_len = args.ctx + k_max + 1
    with torch.device(device):  # random weights made where they run (no host copy of a large model)
        model = CausalLM(cfg, max_positions=max_len).to(dtype).eval()
        head = (
            Eagle3Head(
                Eagle3Config.for_target(
                    cfg, min(args.draft_vocab, cfg.vocab_size), aux_layer_ids=(0,), torch_dtype=args.dtype
                )
            )
            .to(dtype)
            .eval()
        )
    cache = model.new_cache(b_max, max_len)
    draft_cache = head.new_cache(b_max, max_len)
    g = torch.Generator(device=device).manual_seed(0)
    out: dict = {"verify_s": {}, "eagle3_extend_s": {}, "eagle3_draft_pass_s": {}}
    with torch.inference_mode():
        for b in args.batch:
            ctx = torch.full((b,), args.ctx, dtype=torch.long, device=device)
            for k in args.k:
                ids = torch.randint(0, cfg.vocab_size, (b, k + 1), generator=g, device=device)
                pos = ctx.unsqueeze(1) + torch.arange(k + 1, device=device)
                out["verify_s"].setdefault(str(k), {})[str(b)] = timer(
                    lambda ids=ids, pos=pos, ctx=ctx, k=k: model(ids, pos, cache, ctx + k + 1))
                emb = model.embed_tokens(ids)
                hid = torch.randn(b, k + 1, cfg.hidden_size, generator=g, device=device, dtype=dtype)
                last = (torch.full((b, 1), k, dtype=torch.long, device=device))
                out["eagle3_extend_s"].setdefault(str(k), {})[str(b)] = timer(
                    lambda emb=emb, hid=hid, pos=pos, ctx=ctx, k=k, last=last: head(
                        emb, hid, pos, draft_cache, ctx + k + 1, logits_index=last))
            emb1 = model.embed_tokens(torch.randint(0, cfg.vocab_size, (b, 1), generator=g, device=device))
            hid1 = torch.randn(b, 1, cfg.hidden_size, generator=g, device=device, dtype=dtype)
            pos1 = ctx.unsqueeze(1)
            out["eagle3_draft_pass_s"][str(b)] = timer(
                lambda emb1=emb1, hid1=hid1, pos1=pos1, ctx=ctx: head(emb1, hid1, pos1, draft_cache, ctx + 1))
            print(
                f"  {name} L={layers} B={b}: verify k=0 {1e3 * out['verify_s'][str(args.k[0])][str(b)]:.2f} "
                "ms, "
                f"k={k_max} {1e3 * out['verify_s'][str(k_max)][str(b)]:.2f} ms, draft pass "
                f"{1e3 * out['eagle3_draft_pass_s'][str(b)]:.2f} ms",
                flush=True,
            )
    return out  # the model and its caches go with this frame (the caller empties the CUDA cache)


def extrapolate(tables: dict[int, dict], full: int) -> dict:
    """The line through two depths' times, at the full depth: ``t(L) = a + b L`` per (k, B)."""
    (l1, t1), (l2, t2) = sorted(tables.items())

    def at(v1: float, v2: float) -> float:
        return max(v1 + (v2 - v1) * (full - l1) / (l2 - l1), v2)

    return {k: {b: at(s, t2["verify_s"][k][b]) for b, s in row.items()} for k, row in t1["verify_s"].items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument(
        "--layers", default="2,4", help="the two depths measured (the full depth is extrapolated)"
    )
    ap.add_argument("--batch", default=",".join(map(str, DEFAULT_BATCH)))
    ap.add_argument("--k", default=",".join(map(str, DEFAULT_K)))
    ap.add_argument("--ctx", type=int, default=1024, help="cached tokens per row")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a CPU dry run: tiny widths of each model's family, B in 1,2, k in 0,1, 1 and 2 layers",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.batch = [int(x) for x in args.batch.split(",")]
    args.k = [int(x) for x in args.k.split(",")]
    layers = [int(x) for x in args.layers.split(",")]
    models = args.models.split(",")
    if args.quick:
        args.batch, args.k, layers, args.ctx, args.reps, args.warmup = [1, 2], [0, 1], [1, 2], 64, 2, 1
        args.draft_vocab = 256
    if len(layers) != 2 or layers[0] >= layers[1]:
        ap.error("--layers takes two increasing depths, e.g. 2,4")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from megatron_spec.sim.models import get_model

    timer = Timer(device, args.warmup, args.reps)
    entries = []
    for name in models:
        if args.quick:  # the dry run: the family's layout at a width a CPU runs in seconds
            _shrink(name)
        full = builtin_config(name)["num_hidden_layers"]
        print(f"{name}: {full} layers, measuring {layers}", flush=True)
        t0 = time.perf_counter()
        per_depth = {}
        for n in layers:
            per_depth[n] = measure_depth(name, n, args, device, timer)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        cfg = builtin_config(name)
        entries.append(
            {
                "model": name,
                "shape": {
                    k: cfg[k]
                    for k in (
                        "hidden_size",
                        "num_hidden_layers",
                        "num_attention_heads",
                        "num_key_value_heads",
                        "head_dim",
                        "intermediate_size",
                        "vocab_size",
                    )
                },
                "profile_params": get_model(name).total_params,
                "dtype": args.dtype,
                "tp": 1,
                "ctx_per_seq": args.ctx,
                "layers_measured": layers,
                "verify_s": extrapolate(per_depth, full),
                "eagle3_draft_pass_s": per_depth[layers[0]]["eagle3_draft_pass_s"],
                "eagle3_extend_s": per_depth[layers[0]]["eagle3_extend_s"],
                "raw": {str(n): t for n, t in per_depth.items()},
                "seconds": time.perf_counter() - t0,
                "quick": args.quick,
            }
        )
    doc = {
        "generated_by": "benchmarks/measure_forward_costs.py",
        "engine": "megatron-spec native (eager PyTorch)",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "hardware": _hardware_name(device),
        "torch": torch.__version__,
        "commit": _commit(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "entries": entries,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")
    return 0


def _shrink(name: str) -> None:
    """--quick: the builtin config of ``name`` at a toy width (the CPU dry run of the GPU kit)."""
    from megatron_spec.sim import models

    cfg = models._BUILTIN_CONFIGS[name]
    models._BUILTIN_CONFIGS[name] = dict(cfg, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, intermediate_size=128, vocab_size=512)


def _hardware_name(device: torch.device) -> str:
    """The simulator's hardware name of this device (h100, h200, ...), or its own name lower-cased."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for known in ("h200", "h100", "b200", "gb200", "h20"):
        if known in name.replace(" ", ""):
            return known
    return name


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
