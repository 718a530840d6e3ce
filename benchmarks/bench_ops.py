"""Compiled CPU kernels vs their pure-PyTorch references, side by side, with memcpy as the ceiling.

Measures, in one run and interleaved (kernel, reference, kernel, reference, ...) so machine noise
hits both alike:

* memcpy bandwidth: ``dst.copy_(src)`` on 256 MiB buffers, counting bytes read + written, timed
  interleaved with the FP8 quantiser (the load of a shared machine moves both alike);
* FP8 block quantisation of a bf16 weight: GB/s (bytes read + written) of the compiled op, both
  allocating its outputs and writing into preallocated ones (as a weight bucket does, and as the
  memcpy does), and of the reference;
* chain verification at batch B, k drafts: rows/s of the compiled op and the reference at each
  vocabulary size, for dense EAGLE-style draft probabilities (the headline), a reduced draft
  vocabulary through d2t, point-mass (n-gram) drafts, and greedy rows (argmax verification, the
  first draft the target's argmax).

Prints a table, then ONE JSON line with the figures and ratios, the CPU capability
(``megatron_spec.isa``), the compiled kernel variant that ran (``kernel_isa``: default / avx2 /
avx512, csrc/cpu/kernels.h) and the quantised weights' ``dtype``. Targets from issue 3, on every
kind of CPU (issue 14): FP8 C++ >= 3x the reference and >= 30% of memcpy; verification C++ >= 2x the
reference at B=64, k=3, V=152k. ``MEGATRON_SPEC_NO_NATIVE_BF16=1`` measures the AVX2 path on an
AVX-512 machine; ``--kernel-isa`` picks a variant directly.

    python benchmarks/bench_ops.py [--repeats 5] [--fp8-shape 8192 8192] [--vocab 32768 152064]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_spec import _ext, ops
from megatron_spec.isa import probe
from megatron_spec.ops import fp8_block_quantize_reference, verify_chain_reference


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each callable, run interleaved after one warm-up call each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}




def bench_fp8(shape: tuple[int, int], repeats: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g).to(dtype)
    n, k = shape
    out = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-n // 128), -(-k // 128))
    q_c, s_c = ops.fp8_block_quantize(w)
    q_r, s_r = fp8_block_quantize_reference(w)
    assert torch.equal(q_c.view(torch.uint8), q_r.view(torch.uint8)) and torch.equal(s_c, s_r)
    n_mem = 256 << 20
    src = torch.ones(n_mem, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = side_by_side(
        {
            "memcpy": lambda: dst.copy_(src),
            "cpp": lambda: torch.ops.megatron_spec.fp8_block_quantize(w, 128, 128),
            "cpp_out": lambda: torch.ops.megatron_spec.fp8_block_quantize_out(
                w, 128, 128, out=out.view(torch.uint8), scale_inv=scale),
            "torch": lambda: fp8_block_quantize_reference(w),
        },
        repeats,
    )
    nbytes = w.numel() * w.element_size() + out.numel() + scale.numel() * 4
    return {name: (2 * n_mem if name == "memcpy" else nbytes) / sec / 1e9 for name, sec in t.items()}


def verify_inputs(B: int, k: int, V: int, mode: str, g: torch.Generator):
    lp = torch.log_softmax(torch.randn(B, k + 1, V, generator=g) * 2, -1)  # [B, k+1, V]
    x = torch.randint(0, V, (B, k), generator=g)
    q = d2t = None
    if mode == "dense":
        q = torch.softmax(torch.randn(B, k, V, generator=g) * 2, -1)  # [B, k, V]
    elif mode == "d2t":
        Vd = min(32000, V // 2)
        d2t = torch.randperm(V, generator=g)[:Vd].sort().values - torch.arange(Vd)
        q = torch.softmax(torch.randn(B, k, Vd, generator=g) * 2, -1)  # [B, k, Vd]
    greedy = torch.full((B,), mode == "greedy")
    if mode == "greedy" and k:
        x[:, 0] = lp[:, 0].argmax(-1)  # accepted: the row takes two argmax passes
    ua = torch.rand(B, k, dtype=torch.float64, generator=g)
    us = torch.rand(B, dtype=torch.float64, generator=g)
    return lp, x, q, d2t, greedy, ua, us


def bench_verify(B: int, k: int, V: int, mode: str, repeats: int) -> dict[str, float]:
    args = verify_inputs(B, k, V, mode, torch.Generator().manual_seed(V))
    t_c, n_c = torch.ops.megatron_spec.verify_chain(*args)
    t_r, n_r = verify_chain_reference(*args)
    assert torch.equal(t_c, t_r) and torch.equal(n_c, n_r)
    t = side_by_side(
        {
            "cpp": lambda: torch.ops.megatron_spec.verify_chain(*args),
            "torch": lambda: verify_chain_reference(*args),
        },
        repeats,
    )
    return {name: B / sec for name, sec in t.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fp8-shape", type=int, nargs=2, default=[8192, 8192])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 152064])
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16",
                    help="dtype of the weight the FP8 quantiser reads (the trainer's parameters)")
    ap.add_argument("--kernel-isa", choices=["default", "avx2", "avx512"], default=None,
                    help="run this compiled kernel variant (default: the one the extension picked)")
    args = ap.parse_args()
    if not ops.compiled_kernel_for("verify_chain", torch.device("cpu")):
        raise SystemExit(
            "megatron_spec._C is not built (pip install --no-build-isolation -e .): nothing to compare"
        )
    if args.kernel_isa is not None:
        _ext.set_kernel_isa(args.kernel_isa)

    threads = torch.get_num_threads()
    capability, kernel_isa = probe().capability, _ext.kernel_isa()
    print(
        f"threads={threads}  torch={torch.__version__}  cpu_capability={capability}  kernel_isa={kernel_isa} "
        " "
        f"torch_kernels={torch.backends.cpu.get_cpu_capability()}"
    )
    fp8 = bench_fp8(tuple(args.fp8_shape), args.repeats, getattr(torch, args.dtype))
    mem = fp8["memcpy"]
    print(
        f"memcpy                          {mem:8.2f} GB/s (read + write, 256 MiB; interleaved with the FP8 "
        "runs)"
    )
    n, k = args.fp8_shape
    print(f"fp8 quantise {args.dtype} [{n}, {k}]  (GB/s, read + write; fraction of memcpy)")
    for name, label in [("cpp_out", "C++ into preallocated"), ("cpp", "C++ allocating outputs"),
                        ("torch", "PyTorch reference")]:
        print(f"  {label:28s} {fp8[name]:8.2f} GB/s  {fp8[name] / mem:6.1%}")

    result = {
        "cpu_capability": capability,
        "kernel_isa": kernel_isa,
        "dtype": args.dtype,
        "threads": threads,
        "memcpy_gbps": round(mem, 2),
        "fp8_quant_cpp_gbps": round(fp8["cpp_out"], 2),
        "fp8_quant_cpp_alloc_gbps": round(fp8["cpp"], 2),
        "fp8_quant_torch_gbps": round(fp8["torch"], 3),
        "fp8_quant_cpp_over_torch": round(fp8["cpp"] / fp8["torch"], 2),
        "fp8_quant_fraction_of_memcpy": round(fp8["cpp_out"] / mem, 3),
        "fp8_quant_alloc_fraction_of_memcpy": round(fp8["cpp"] / mem, 3),
    }
    print(f"verify chain B={args.batch} k={args.k}  (rows/s)")
    for V in args.vocab:
        for mode in ("dense", "d2t", "point", "greedy"):
            r = bench_verify(args.batch, args.k, V, mode, args.repeats)
            ratio = r["cpp"] / r["torch"]
            print(f"  V={V:<7d} q={mode:6s} C++ {r['cpp']:10.1f}   PyTorch {r['torch']:8.1f}   {ratio:6.1f}x")
            tag = f"V{V}_{mode}"
            result[f"verify_cpp_rows_per_s_{tag}"] = round(r["cpp"], 1)
            result[f"verify_torch_rows_per_s_{tag}"] = round(r["torch"], 2)
            result[f"verify_cpp_over_torch_{tag}"] = round(ratio, 2)
    head = f"V{max(args.vocab)}_dense"
    result["verify_cpp_over_torch"] = result[f"verify_cpp_over_torch_{head}"]
    targets = {
        "fp8_quant_cpp_over_torch >= 3": result["fp8_quant_cpp_over_torch"] >= 3,
        "fp8_quant_fraction_of_memcpy >= 0.3": result["fp8_quant_fraction_of_memcpy"] >= 0.3,
        f"verify_cpp_over_torch ({head}) >= 2": result["verify_cpp_over_torch"] >= 2,
    }
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'NOT met'}")
    result["targets_met"] = all(targets.values())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
