"""Where the milliseconds of a native-engine step go, on the real model (issue 30, item 1).

    python benchmarks/profile_engine_step.py [--model smollm2] [--draft runs/smollm2_eagle3_refined]
        [--dtypes auto,float32] [--batch-sizes 1,16] [--k 3]

Two levels, per dtype and batch size B:

* **Forward** (``CausalLM.forward`` over a cache of ~128 positions): a decode forward (1 token a
  row) and a verify forward (k+1 tokens a row, logits at every position). Its wall time unprofiled
  (median of ``--repeats``), then one profiled pass whose op time is split by the innermost of
  these scopes: projections (the packed q/k/v, o, gate/up and down linears), LM head, attention
  (the kernel), KV-cache writes, rotary, norms, SwiGLU activation, and everything else the layer
  loop runs (views, splits, residual adds, masks: "other ops"). "Between ops" is the unprofiled
  wall time less the profiled op time: Python and dispatch (never below 0; the profiler's own
  cost makes it an under-estimate).
* **Engine step** (``EngineCore.generate`` of 2B chat prompts, 64 new tokens, greedy), plain
  decoding and EAGLE-3 k=3: time per step (one target forward a step) split by the wall time inside
  the target forward, the draft (its proposal and its commit: the EAGLE-3 extend pass over the
  accepted tokens), sampling and verification (``process_logits``, sampling, ``verify_chain``) and
  the scheduler's own host work (the rest), scaled to the unprofiled run's wall time.

The scopes are added here by wrapping the functions from outside (the engine's code carries no
profiling). Prints both tables (markdown, for docs/benchmark_log.md) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

FORWARD_SCOPES = ("projections", "lm_head", "attention", "kv_write", "rotary", "norms", "activation")
ENGINE_SCOPES = ("target_forward", "draft", "sampling_verify")


def _scoped(fn, name):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        with record_function(f"@{name}"):
            return fn(*a, **kw)

    return wrapper


@contextlib.contextmanager
def patched(pairs):
    """Wrap ``(owner, attribute, scope)`` in ``record_function`` scopes for the block (a subclass listed
    before its base gets its own wrapper of the inherited function)."""
    saved = [
        (o, a, o.__dict__.get(a) if isinstance(o, type) else getattr(o, a), a in vars(o)) for o, a, _ in pairs
    ]
    try:
        for o, a, name in pairs:
            setattr(o, a, _scoped(getattr(o, a), name))
        yield
    finally:
        for o, a, f, own in reversed(saved):
            if own:
                setattr(o, a, f)
            else:
                delattr(o, a)


@contextlib.contextmanager
def python_layers():
    """Every decoder layer in Python for the block (not ``megatron_spec::decoder_layers``, whose ops the
    scopes
    below cannot see)."""
    from megatron_spec.layers import fused_layers

    saved, fused_layers.FUSED_LAYERS = fused_layers.FUSED_LAYERS, False
    try:
        yield
    finally:
        fused_layers.FUSED_LAYERS = saved


def forward_scopes():
    import torch.nn.functional as F

    from megatron_spec.layers import decoder, kv_cache, linear
    from megatron_spec.rollout.native import model

    return [(linear.TiedLinear, "forward", "lm_head"), (linear.Linear, "forward", "projections"),
            (model.CausalLM, "head", "lm_head"),
            (decoder, "attend", "attention"), (decoder, "gqa_attention", "attention"),
            (F, "scaled_dot_product_attention", "attention"),
            (kv_cache.KVCache, "write", "kv_write"), (decoder.Rotary, "apply", "rotary"),
            (decoder.RMSNorm, "forward", "norms"), (F, "silu", "activation")]


def engine_scopes():
    from megatron_spec.rollout.native import drafters, engine, model, spec_step

    return [
        (model.CausalLM, "forward_segments", "target_forward"),
        (drafters.Eagle3Drafter, "propose", "draft"),
        (drafters.Eagle3Drafter, "commit", "draft"),
        (engine, "process_logits", "sampling_verify"),
        (engine, "sample_from_logprobs", "sampling_verify"),
        (spec_step, "verify_chain", "sampling_verify"),
    ]


def split_by_scope(prof, scopes) -> dict[str, float]:
    """Self CPU time (seconds) of the profiled ops, by their innermost ``@scope`` (``@lm_head`` wins
    over the projection scope of the head's own linear); ``other`` outside any."""
    out = dict.fromkeys((*scopes, "other"), 0.0)
    for ev in prof.events():
        if ev.name.startswith("@"):
            continue
        parent, scope = ev.cpu_parent, None
        while parent is not None:
            if parent.name == "@lm_head":
                scope = "lm_head"
                break
            if parent.name.startswith("@") and scope is None:
                scope = parent.name[1:]
            parent = parent.cpu_parent
        out[scope if scope in out else "other"] += ev.self_cpu_time_total / 1e6
    return out


def scope_wall(prof, scopes) -> dict[str, float]:
    """Wall time (seconds) inside each ``@scope``, outermost occurrences only (Python time included)."""
    out = dict.fromkeys(scopes, 0.0)
    for ev in prof.events():
        if not ev.name.startswith("@") or ev.name[1:] not in out:
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith("@"):
            parent = parent.cpu_parent
        if parent is None:
            out[ev.name[1:]] += ev.cpu_time_total / 1e6
    return out


def median_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def profile_forward(target, b: int, t: int, repeats: int, context: int = 128) -> dict:
    cache = target.new_cache(b, context + 16)
    vocab = target.cfg.vocab_size
    with torch.inference_mode():
        target(torch.randint(0, vocab, (b, context)), torch.arange(context).expand(b, context), cache,
               torch.full((b,), context), logits_index=torch.full((b, 1), context - 1))
        ids = torch.randint(0, vocab, (b, t))
        pos = torch.arange(context, context + t).expand(b, t)
        lens = torch.full((b,), context + t)

        def step():
            target(ids, pos, cache, lens)

        for _ in range(3):
            step()
        # the layers in C++ where they run there (fused_layers.fused_stack)
        wall_fused = median_time(step, repeats)
        with python_layers():  # the Python layers: their ops are split by scope below
            step()
            wall = median_time(step, repeats)
        with python_layers(), patched(forward_scopes()):
            step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    step()
    parts = {k: v / 3 for k, v in split_by_scope(prof, FORWARD_SCOPES).items()}
    parts["between_ops"] = max(0.0, wall - sum(parts.values()))
    return {"wall_s": wall, "wall_fused_s": wall_fused, "parts_s": parts}


def profile_engine(server, prompts, new_tokens: int) -> dict:
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, sp) for i, p in enumerate(prompts)]
    server.core.generate(reqs[:1], seed=0)
    _, st = server.core.generate(reqs, seed=0)  # unprofiled
    with patched(engine_scopes()):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _, pst = server.core.generate(reqs, seed=0)
    steps = sum(ev.name == "@target_forward" for ev in prof.events())  # one target forward a step
    parts = scope_wall(prof, ENGINE_SCOPES)
    profiled_wall = pst.wall_s
    parts["scheduler_host"] = max(0.0, profiled_wall - sum(parts.values()))
    scale = st.wall_s / profiled_wall  # profiled shares applied to the unprofiled wall time
    return {"tokens_per_s": st.tokens_per_s, "steps": steps, "wall_s": st.wall_s,
            "per_step_ms": {k: 1e3 * v * scale / steps for k, v in parts.items()},
            "step_ms": 1e3 * st.wall_s / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default=os.path.join(ROOT, "runs", "smollm2_eagle3_refined"))
    ap.add_argument("--dtypes", default="auto,float32")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_rollout"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from _real_model import chat_prompts
    from megatron_spec.isa import resolve_dtype
    from megatron_spec.layers.linear import pack_linears
    from megatron_spec.models.checkpoint import HFCheckpoint
    from megatron_spec.models.fetch import resolve_model
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.model import CausalLM
    from megatron_spec.rollout.native.server import EngineServer

    path = resolve_model(args.model)
    ck = HFCheckpoint(path)
    tok = AutoTokenizer.from_pretrained(path)
    dtypes = list(dict.fromkeys(resolve_dtype(d) for d in args.dtypes.split(",")))
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    kinds = ("none", "eagle3") if os.path.isdir(args.draft) else ("none",)
    if len(kinds) == 1:
        print(f"[engine] no EAGLE-3 draft at {args.draft}: plain decoding only", file=sys.stderr)
    result: dict = {"model": args.model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "threads": args.threads, "forward": {}, "engine": {}}
    for dtype in dtypes:
        target = CausalLM(ck.decoder_config, max_positions=512).to(getattr(torch, dtype)).eval()
        target.load_weights((n, ck.get(n)) for n in ck.weight_names())
        pack_linears(target)
        for b in sizes:
            for name, t in (("decode", 1), ("verify", args.k + 1)):
                r = profile_forward(target, b, t, args.repeats)
                result["forward"][f"{dtype}_b{b}_{name}"] = r
                print(
                    f"[forward] {dtype} B={b} {name}: {1e3 * r['wall_s']:.1f} ms", file=sys.stderr, flush=True
                )
        del target
        for b in sizes:
            prompts = chat_prompts(tok, args.work_dir, 2 * b, seed=5)
            width = max(map(len, prompts))
            for kind in kinds:
                srv = EngineServer(EngineConfig(model_path=path, draft_kind=kind,
                                                draft_path=args.draft if kind == "eagle3" else None,
                                                num_draft_tokens=args.k, dtype=dtype, max_batch_size=b,
                                                context_length=width + args.new_tokens + args.k + 1,
                                                num_threads=args.threads))
                r = profile_engine(srv, prompts, args.new_tokens)
                result["engine"][f"{dtype}_b{b}_{'ar' if kind == 'none' else f'eagle3_k{args.k}'}"] = r
                print(
                    f"[engine] {dtype} B={b} {kind}: {r['tokens_per_s']:.1f} tokens/s",
                    file=sys.stderr,
                    flush=True,
                )
                del srv

    print(
        "\nForward, ms (unprofiled wall time of the Python layers, parts from one profiled pass of them; and "
        "the "
        "wall time with the layers in C++, csrc/decoder_cpu.cpp, where they run):\n"
    )
    cols = (*FORWARD_SCOPES, "other", "between_ops")
    print("| forward | wall | " + " | ".join(cols) + " | wall, C++ layers |")
    print("|---" * (len(cols) + 3) + "|")
    for key, r in result["forward"].items():
        print(
            f"| {key} | {1e3 * r['wall_s']:.1f} | "
            + " | ".join(f"{1e3 * r['parts_s'][c]:.1f}" for c in cols)
            + f" | {1e3 * r['wall_fused_s']:.1f} |"
        )
    print("\nEngine step, ms per step (greedy, 64 new tokens; parts scaled to the unprofiled wall time):\n")
    cols = (*ENGINE_SCOPES, "scheduler_host")
    print("| run | tokens/s | step | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 3) + "|")
    for key, r in result["engine"].items():
        print(f"| {key} | {r['tokens_per_s']:.1f} | {r['step_ms']:.1f} | "
              + " | ".join(f"{r['per_step_ms'][c]:.1f}" for c in cols) + " |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
