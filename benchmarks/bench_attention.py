"""The engine's fp32 attention: the extension's kernel against torch's (issue 30).

    python benchmarks/bench_attention.py [--repeats 200]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads of 64) over views of a slot cache like the
engine's (``cache[:b, :, :L]`` of ``[16, 3, 1100, 64]``), for decode (t = 1 query a row) and verify
(t = 4) at batch 1, 4 and 16 and 128 or 1024 cached positions: ``megatron_spec::attention_f32``
(``csrc/attention_cpu.cpp``) against what the layers ran before it, torch's
``scaled_dot_product_attention`` or ``layers.decoder.gqa_attention`` (whichever
``use_fused_attention`` picks for the shape). Mean microseconds over ``--repeats`` calls after 10
warm-up calls, the two alternated per shape. Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(1, 1, 128), (1, 4, 128), (16, 1, 128), (16, 4, 128), (4, 1, 1024), (16, 1, 1024), (16, 4, 1024)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import megatron_spec.ops  # noqa: F401  (registers the fake kernels)
    from megatron_spec.layers.decoder import attention_kernel_available, gqa_attention, use_fused_attention

    if not attention_kernel_available():
        ap.error("the extension (megatron_spec._C) is not built: nothing to compare")

    def mean_us(fn) -> float:
        for _ in range(10):
            fn()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        return (time.perf_counter() - t0) / args.repeats * 1e6

    torch.manual_seed(0)
    kc, vc = torch.randn(16, 3, 1100, 64), torch.randn(16, 3, 1100, 64)
    result = {}
    print("| rows x queries, positions | kernel, us | torch, us | torch / kernel |\n|---|---|---|---|")
    with torch.inference_mode():
        for b, t, length in SHAPES:
            q = torch.randn(b, t, 9, 64).transpose(1, 2)
            k, v = kc[:b, :, :length], vc[:b, :, :length]
            mask = torch.ones(b, 1, t, length, dtype=torch.bool)
            fused = use_fused_attention(torch.float32, b, t)

            def before(q=q, k=k, v=v, mask=mask, fused=fused):
                if fused:
                    return F.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True
                    )
                return gqa_attention(q, k, v, mask, 0.125)

            def kernel_call(q=q, k=k, v=v, mask=mask):
                return torch.ops.megatron_spec.attention_f32(q, k, v, mask, 0.125)

            kernel = mean_us(kernel_call)
            torch_us = mean_us(before)
            result[f"b{b}_t{t}_L{length}"] = {"kernel_us": round(kernel, 1), "torch_us": round(torch_us, 1)}
            print(
                f"| {b} x {t}, {length} | {kernel:.0f} | {torch_us:.0f} | {torch_us / kernel:.1f} |",
                flush=True,
            )
    print(json.dumps({"threads": args.threads, "shapes": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
