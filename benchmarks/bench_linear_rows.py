"""The engine's fp32 projections at each row count: the extension's kernel (fp32 and bf16 weight panels)
against oneDNN (issue 30).

    python benchmarks/bench_linear_rows.py [--rows 1,2,4,8,12,16,32,64,128,256] [--repeats 5]

SmolLM2-135M's shapes with random weights: 30 layers of q (576x576), k and v (192x576), o (576x576),
gate and up (1536x576) and down (576x1536), and the tied 49152x576 head, each a ``layers.linear.Linear``
packed as the engine packs it (oneDNN's blocked copy and the 16-output panels of ``csrc/linear_cpu.cpp``).
For each row count M, one pass over all 211 matrices with M input rows through
``megatron_spec::linear_small_f32`` and one through oneDNN's ``mkldnn._linear_pointwise``; best of
``--repeats`` passes each, the two alternated. M is what a forward feeds the projections: B rows at
decode, B (k + 1) at a verify, the prompt's tokens at a prefill. ``layers.linear.SMALL_MAX_ROWS`` is
set from this table. The weights are bf16 numbers (as a bf16 checkpoint loaded in fp32 is), so the kernel
also runs on their bf16 panels (``linear_pack_bf16w``, ``layers.linear.BF16_WEIGHT_PANELS``: the same
results, half the bytes), a third pass alternated with the other two. On an AVX-512 CPU the kernel runs its
AVX-512 tile (the engine's) and its AVX2 tile too (``avx2_over_avx512_tile``), all alternated. Prints a
markdown table and one JSON line (``cpu_kind``, ``kernel_isa``).

    python benchmarks/bench_linear_rows.py --dtype bfloat16

The bf16 engine's projections instead (bf16 weights and inputs, a CPU with AVX512-BF16 dot products):
``megatron_spec::linear_small_bf16`` on the panels ``linear_pack_bf16`` makes against oneDNN's packed bf16
matmul, alternated; ``layers.linear.SMALL_MAX_ROWS_BF16`` is set from this table. On a CPU with AMX the kernel
runs twice, on AMX tiles and on AVX512-BF16 dot products (``megatron_spec._ext.set_amx``), all three
alternated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # (out, in)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,12,16,32,64,128,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.dtype == "bfloat16":
        return bf16_engine(ap, args)
    from megatron_spec.layers.linear import Linear, small_linear_available

    if not small_linear_available():
        ap.error("the extension (megatron_spec._C) is not built: nothing to compare")
    torch.manual_seed(0)
    layers = []
    for out, inp in SHAPES * args.layers + [(49152, 576)]:
        lin = Linear(inp, out, bias=False).eval()
        with torch.no_grad():
            lin.weight.copy_(lin.weight.bfloat16().float())
        lin.pack()
        assert lin._small.dtype == torch.bfloat16
        lin.fp32_panels = torch.ops.megatron_spec.linear_pack_f32(lin.weight.contiguous())
        layers.append(lin)
    ops = torch.ops.megatron_spec
    from megatron_spec import _ext
    from megatron_spec.isa import probe

    # On an AVX-512 CPU the kernel's AVX-512 tile (the engine's, except on AMD Zen 4) and its AVX2 tile (a
    # CPU without AVX-512, MEGATRON_SPEC_NO_NATIVE_BF16=1, AMD Zen 4) run alternated, through the tests'
    # switches: the same bits, other speeds.
    isa = _ext.kernel_isa()
    tiles = [isa] + (["avx2"] if isa == "avx512" else [])

    def one_pass(m: int, kernel: str) -> float:
        panels, _, tile = kernel.partition("/")
        xs = {576: torch.randn(m, 576), 1536: torch.randn(m, 1536)}
        if tile:
            _ext.set_kernel_isa(tile)
            if tile == "avx512":  # its own tiles, also where the engine would run the AVX2 ones (AMD Zen 4)
                _ext.set_fp32_avx512_tiles(True)
        t0 = time.perf_counter()
        for lin in layers:
            x = xs[lin.in_features]
            if tile:
                w = lin._small if panels == "bf16" else lin.fp32_panels
                ops.linear_small_f32(x, w, None, lin.out_features)
            else:
                torch.ops.mkldnn._linear_pointwise(x, lin._packed, None, "none", [], "")
        return time.perf_counter() - t0

    kernels = [f"{p}/{t}" for t in tiles for p in ("fp32", "bf16")] + ["onednn"]
    rows = [int(r) for r in args.rows.split(",")]
    result = {}
    with torch.inference_mode():
        for m in rows:  # warm-up: oneDNN's primitives per shape
            for k in kernels:
                one_pass(m, k)
        second = len(tiles) > 1
        heads = [f"{k} panels / tile, ms" if k != "onednn" else "oneDNN, ms" for k in kernels]
        heads += ["oneDNN / kernel (fp32)", "fp32 / bf16 panels"]
        heads += ["avx2 / avx512 tile (bf16)"] if second else []
        print("| rows | " + " | ".join(heads) + " |\n|" + "---|" * (len(heads) + 1))
        for m in rows:
            times = {k: [] for k in kernels}
            for _ in range(args.repeats):
                for k in kernels:  # alternated
                    times[k].append(one_pass(m, k))
            best = {k: min(v) for k, v in times.items()}
            k, b, o = best[f"fp32/{isa}"], best[f"bf16/{isa}"], best["onednn"]
            result[m] = {
                "kernel_ms": round(k * 1e3, 2),
                "kernel_bf16_panels_ms": round(b * 1e3, 2),
                "onednn_ms": round(o * 1e3, 2),
                "ratio": round(o / k, 3),
                "fp32_over_bf16_panels": round(k / b, 3),
            }
            if second:
                result[m].update(avx2_tile_ms=round(best["fp32/avx2"] * 1e3, 2),
                                 avx2_tile_bf16_panels_ms=round(best["bf16/avx2"] * 1e3, 2),
                                 avx2_over_avx512_tile=round(best["bf16/avx2"] / b, 3),
                                 avx2_over_avx512_tile_fp32=round(best["fp32/avx2"] / k, 3))
            cells = [f"{best[x] * 1e3:.1f}" for x in kernels] + [f"{o / k:.2f}", f"{k / b:.2f}"]
            cells += [f"{best['bf16/avx2'] / b:.2f}"] if second else []
            print(f"| {m} | " + " | ".join(cells) + " |", flush=True)
        _ext.set_kernel_isa(isa)
    print(json.dumps({"threads": args.threads, "cpu_kind": probe().kind, "kernel_isa": isa, "tiles": tiles,
                      "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": result}))
    return 0


def bf16_engine(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--dtype bfloat16``: the bf16 kernel against oneDNN's bf16 matmul, each matrix packed as the engine
    packs it."""
    from megatron_spec.layers.linear import Linear, bf16_small_linear_available

    if not bf16_small_linear_available():
        ap.error(
            "no AVX512-BF16 kernel here (megatron_spec._C not built, or a CPU without bf16 dot products)"
        )
    torch.manual_seed(0)
    layers = []
    for out, inp in SHAPES * args.layers + [(49152, 576)]:
        lin = Linear(inp, out, bias=False).eval().to(torch.bfloat16)
        lin.pack()
        assert lin._small is not None and lin._small.dim() == 4
        layers.append(lin)

    from megatron_spec import _ext
    from megatron_spec.isa import probe

    amx = _ext.amx_supported() and _ext.amx_active()  # AMX tiles too (MEGATRON_SPEC_NO_AMX=1: not)

    def one_pass(m: int, kernel: str) -> float:
        xs = {576: torch.randn(m, 576).bfloat16(), 1536: torch.randn(m, 1536).bfloat16()}
        if kernel != "onednn" and amx:
            _ext.set_amx(kernel == "amx")
        t0 = time.perf_counter()
        for lin in layers:
            x = xs[lin.in_features]
            if kernel != "onednn":
                torch.ops.megatron_spec.linear_small_bf16(x, lin._small, None, lin.out_features)
            else:
                torch.ops.mkldnn._linear_pointwise(x, lin._packed, None, "none", [], "")
        return time.perf_counter() - t0

    kernels = (["amx"] if amx else []) + ["avx512bf16", "onednn"]
    rows = [int(r) for r in args.rows.split(",")]
    result = {}
    with torch.inference_mode():
        for m in rows:
            for k in kernels:
                one_pass(m, k)
        print("| rows | " + " | ".join(f"{k}, ms" for k in kernels) + " | oneDNN / best kernel |"
              + (" AVX512-BF16 / AMX |" if amx else "") + "\n|" + "---|" * (len(kernels) + 2 + amx))
        for m in rows:
            times = {k: [] for k in kernels}
            for _ in range(args.repeats):
                for k in kernels:  # alternated
                    times[k].append(one_pass(m, k))
            best = {k: min(v) for k, v in times.items()}
            ours = best["amx"] if amx else best["avx512bf16"]
            result[m] = {f"{k}_ms": round(v * 1e3, 2) for k, v in best.items()}
            result[m]["ratio"] = round(best["onednn"] / ours, 3)
            if amx:
                result[m]["avx512bf16_over_amx"] = round(best["avx512bf16"] / best["amx"], 3)
            print(
                f"| {m} | "
                + " | ".join(f"{best[k] * 1e3:.1f}" for k in kernels)
                + f" | {best['onednn'] / ours:.2f} |"
                + (f" {best['avx512bf16'] / best['amx']:.2f} |" if amx else ""),
                flush=True,
            )
        if amx:
            _ext.set_amx(True)
    print(
        json.dumps(
            {
                "threads": args.threads,
                "dtype": "bfloat16",
                "cpu_kind": probe().kind,
                "kernels": kernels,
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "rows": result,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
