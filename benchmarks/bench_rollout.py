"""Rollout throughput of the native engine, side by side in one run.

    python benchmarks/bench_rollout.py [--base DIR] [--dtypes auto,float32] [--batch-sizes 1,4,16]

Every dtype goes through ``megatron_spec.isa.resolve_dtype``: ``auto`` is bf16 where this CPU does
bf16 natively and fp32 elsewhere, an explicit ``bfloat16`` on a CPU without native bf16 runs (and is
reported) as fp32, and duplicates are measured once. The headline keys are those of the dtype
``auto`` picks; the JSON line says which (``dtype``) and on what CPU (``cpu_capability``).

Target: 109M parameters (hidden 1024, 8 layers, 32 heads / 8 KV heads, SwiGLU 3584; fp32
weights 437 MB, bf16 218 MB: far larger than the caches, so decode is memory-bound as on a
GPU). Its function is that of a small model trained on the demo task (``--base``, or one made
here with launch/sft_base.py), embedded exactly in the wider network (benchmarks/_expand.py):
the cost of a 109M model, the predictable step-by-step outputs of a trained one.
Drafts: an EAGLE-3 head trained by ModelOpt on the small model's own continuations and
widened the same way; a separately trained 0.8M model of the same family and tokenizer as
the draft model (also the assistant of transformers' assisted generation); n-gram.
Workload: the demo task's prompts (``sum``), greedy, responses end at EOS.

``--model smollm2`` (or a Hub id) measures a real pretrained model instead (issue 28;
benchmarks/_real_model.py): SmolLM2-135M-Instruct as ``megatron-spec fetch-model`` makes it, its
chat-formatted held-out prompts (mathematics_dataset ``algebra__linear_1d``, interpolate split),
its ModelOpt EAGLE-3 draft (``--draft``, or trained here on its answers to the train-easy split)
and, as the draft model, its own first ``--draft-layers`` layers with its final norm and tied
head. Defaults there: batch sizes 1 and 16, k = 3, 64 new tokens, 3 rounds; the GRPO workload
on its chat prompts with AR, EAGLE-3 k=3, EAGLE-3 auto and EAGLE-3 + history, 64 new tokens, 2
rounds. Extra keys: ``real_model``, ``ar_over_hf_generate_b1``, ``eagle3_k3_over_ar_b16`` and
``eagle3_accept_length_k3_t1`` (EAGLE-3 k=3 sampled at T=1, the median over batch sizes); every
run has ``accept_pos_k3`` / ``accept_pos_k3_t1`` per batch size in ``per_config`` (the share of
verify steps accepting at least 1, 2, 3 drafts).

Measured per dtype and batch size B (tokens/s, all through the same engine code; the engine
configurations of a round run step by step in turn, each on its own clock (``--interleave steps``,
``_lockstep.py``; ``calls``: one whole call after the other), 5 rounds, so the machine's drift hits them
alike; tokens/s is a config's best round, and the speed-up over AR is the median of the rounds' paired
ratios):
  * this engine, plain decoding (greedy, and sampling at T=1 for the transformers comparison);
  * EAGLE-3 with k = 1..5, the draft model and n-gram prompt lookup (k=3), with acceptance lengths;
  * transformers ``generate`` sampling at T=1; transformers assisted generation with the same
    draft model (batch 1 only: it supports no more).
Then the cost model: v = (target forward over k+1 tokens) / (one AR step), c = (one draft
step) / (one AR step), measured on the same batch, and the speculation ceiling
tau / (v + k c) with tau the measured acceptance length. A draft step is the drafter's whole
proposal of k tokens over k (EAGLE-3: the fc fusion of the aux states once, k passes of the
draft layer, the embedding lookups, argmax and d2t), timed back to back (the draft's weights
stay warm); ``c_in_loop`` times the proposal right after a verify forward, as the engine runs
it, and gives a second, lower ceiling (``*_in_loop``) reported beside the first. Speculation
pays only while v is close to 1 (memory-bound decode); on 2 CPU cores that regime ends at a
small batch.

Adaptive draft length (issue 18): ``eagle3_auto`` (``num_draft_tokens auto``, k_max the largest k measured)
runs in the same rounds; ``adaptive_over_best_fixed`` is its paired ratio over the best fixed k in 0..k_max at
that batch size (k = 0 is AR; the fastest by its median round), ``adaptive_over_best_fixed_min`` the minimum
over batch sizes, ``adaptive_over_best_fixed_interval`` (per dtype and batch size, from 3 rounds) a 90%
bootstrap interval of that median and ``per_config``'s ``adaptive_round_ratios`` the rounds' ratios: whether
the rounds resolve a target a few percent from 1. The same at T=1 (on unless ``--no-adaptive-t1``): a second
adaptive engine ``eagle3_auto_t1`` (its controller learns T=1's acceptance) against plain decoding and every
fixed k sampled (``eagle3_k{k}_t1``), keys with ``_t1`` (``adaptive_over_best_fixed_t1_min`` and so on).

GRPO-shaped workload (``--sections grpo``): the demo task with 2..12 terms (``--grpo-task
sum_long``; one response step per term, so lengths vary 4x and the batch has a long tail as an RL
batch does), on its own small base, ModelOpt EAGLE-3 draft and widened target trained on that task
exactly as the main table's are on ``sum`` (``WORK_DIR/models_sum_long``), 16 prompts x 8 samples
through max batch 16, temperature 1, responses ending at EOS, every prompt seen once before (each
measured call follows a priming call on the same prompts with another seed; the history index is
emptied before the priming call, so "earlier rollouts" are exactly one step's). Configs, interleaved
round by round: AR, EAGLE-3 k=2, 3, 4 and 5, EAGLE-3 auto, history alone (auto, k_max 10), EAGLE-3 +
history (auto; EAGLE-3 up to 5, history up to 10 tokens in steps where it drafts alone; tree steps
where the controller expects them to pay), and the same without tree steps (``--history-tree off``). Keys:
``adaptive_over_k3_grpo``, ``best_fixed_grpo`` (the fastest of AR and k=2..5, median tokens/s) and
``adaptive_over_best_fixed_grpo`` (with ``..._interval``, a 90% bootstrap interval over the rounds, and
``grpo_round_ratios``, every config over AR round by round), ``length_oracle_over_k3_grpo`` (the
ceiling of any draft-length choice over fixed k=3 at batch 16, from EAGLE-3 k=5's acceptance per position
and the adaptive engine's measured costs: ``length_policy_ceiling``; ``..._by_batch`` at 16, 8, 4),
``history_accept_length_grpo`` (1 + drafts accepted per history-drafted request-step, in the
combined run), ``combined_over_eagle3_grpo`` (over EAGLE-3 auto), ``tree_over_no_tree_grpo``
(combined over combined without trees), ``tail_speedup_grpo`` (time from the 90th-percentile
sample's finish to the last one's, AR over combined). ``--sections``
limits the run to some of: main, grpo, fresh, drafts; ``--grpo-configs`` the GRPO workload to some configs.

Fresh prompts (``--sections fresh``, issue 31): the same 16 x 8 workload at T=1 on prompts no call has
seen (the history emptied before every call, no priming call): AR, EAGLE-3 auto, EAGLE-3 auto +
history + the live group index (``combined``) and the same without the live index. Keys:
``live_history_frac`` (drafted tokens the target accepted from the live index over all emitted
tokens), ``combined_over_eagle3_fresh``, ``live_over_no_live_fresh``, ``tail_speedup_fresh`` (AR
over combined), ``fresh_per_config``.

Draft kinds (``--sections drafts``, with ``--model``): EAGLE-3, MTP (``--mtp``), the truncated and
the distilled draft model (``--draft-model``) and n-gram at k = 3 against AR, greedy and T=1, batch 1,
interleaved: ``drafts_b1`` (per kind acceptance length, per position, paired speed-up over AR at the
same temperature), ``mtp_accept_length_k3[_t1]``, ``draft_model_distilled_accept_length_k3[_t1]``.

Prints a table and, last, one JSON line with the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WIDE = dict(hidden=1024, heads=32, kv_heads=8, intermediate=3584)


def task_prompts(tokenizer, n: int, seed: int, task: str = "sum") -> list[list[int]]:
    from megatron_spec.rl.synthetic_tasks import generate

    return [tokenizer(e.prompt, add_special_tokens=False)["input_ids"] for e in generate(task, n, seed)]


def build_models(work: str, base: str | None, sft_steps: int, eagle_steps: int,
                 task: str = "sum") -> dict[str, str]:
    """Small base (trained on ``task``), its ModelOpt EAGLE-3 draft, and both widened; cached in ``work``."""
    from transformers import AutoTokenizer

    from _expand import expand_decoder, expand_eagle3
    from megatron_spec.draft.modelopt_train import train_and_export_eagle3
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    os.makedirs(work, exist_ok=True)
    small = base or os.path.join(work, "small")
    if not os.path.isdir(small):
        print("[setup] training the small base model (launch/sft_base.py)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "launch", "sft_base.py"), "--out", small,
                        "--steps", str(sft_steps), "--task", task], check=True)
    paths = {
        "small": small,
        "target": os.path.join(work, "target"),
        "eagle3": os.path.join(work, "eagle3"),
        "eagle3_small": os.path.join(work, "eagle3_small"),
        "draft_model": os.path.join(work, "draft_model"),
    }
    if not os.path.isdir(paths["draft_model"]):
        # a separately trained, 8x smaller model of the same family and tokenizer (like a 0.6B
        # drafting for an 8B): it agrees with the target often, not always
        print(
            "[setup] training the draft model (launch/sft_base.py, 0.8M parameters)",
            file=sys.stderr,
            flush=True,
        )
        subprocess.run(
            [
                sys.executable,
                os.path.join(ROOT, "launch", "sft_base.py"),
                "--out",
                paths["draft_model"],
                "--steps",
                "150",
                "--hidden-size",
                "128",
                "--intermediate-size",
                "384",
                "--num-layers",
                "4",
                "--num-attention-heads",
                "4",
                "--num-kv-heads",
                "2",
                "--seed",
                "7",
                "--task",
                task,
            ],
            check=True,
        )
    if not os.path.isdir(paths["eagle3_small"]):
        print(
            "[setup] EAGLE-3 draft trained by ModelOpt on the base's continuations",
            file=sys.stderr,
            flush=True,
        )
        tok = AutoTokenizer.from_pretrained(small)
        prompts = task_prompts(tok, 512, seed=777, task=task)
        long = task != "sum"  # sum_long: up to 24 prompt and ~100 response tokens
        srv = EngineServer(
            EngineConfig(model_path=small, max_batch_size=64, context_length=192 if long else 160)
        )
        samples, _ = srv.generate(
            [
                GenerateRequest(
                    str(i), p, SamplingParams(temperature=0.0, max_new_tokens=144 if long else 96)
                )
                for i, p in enumerate(prompts)
            ]
        )
        seqs = [p + s.output_ids for p, s in zip(prompts, samples)]
        train_and_export_eagle3(small, paths["eagle3_small"], seqs, steps=eagle_steps, batch_size=16,
                                max_len=160 if long else 96,
                                ttt_steps=3, lr=3e-3, export_rope_scaling={}, progress=True)
    if not os.path.isdir(paths["target"]):
        expand_decoder(small, paths["target"], **WIDE)
    if not os.path.isdir(paths["eagle3"]):
        expand_eagle3(paths["eagle3_small"], paths["eagle3"], **WIDE)
    return paths


def _server(paths, dtype: str, kind: str, k, batch: int, new_tokens: int, prompt_len: int = 32, **kw):
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer

    draft = kw.pop("draft_path", None) or {"eagle3": paths["eagle3"], "model": paths["draft_model"]}.get(kind)
    return EngineServer(EngineConfig(model_path=paths["target"], draft_kind=kind, draft_path=draft,
                                     num_draft_tokens=k, dtype=dtype, max_batch_size=batch,
                                     context_length=prompt_len + new_tokens, num_threads=2, **kw))


def _prompt_width(prompts) -> int:
    """The prompt room of a server's context: the longest prompt, at least the demo task's 32."""
    return max(32, max(map(len, prompts)))


def _reset_history(server) -> None:
    """Empty the history index of a server's history drafter (main or beside), if it has one."""
    for d in (server.core.drafter, server.core.history):
        if d is not None and d.kind == "history":
            d.reset()


def tail_seconds(finish_times: list[float]) -> float:
    """Time from the 90th-percentile sample's finish to the last one's."""
    t = sorted(finish_times)
    return t[-1] - t[max(0, -(-9 * len(t) // 10) - 1)]


GRPO_CONFIGS = (
    "ar",
    "eagle3_k2",
    "eagle3_k3",
    "eagle3_k4",
    "eagle3_k5",
    "eagle3_auto",
    "history_auto",
    "combined",
    "combined_no_tree",
)


def length_policy_ceiling(at_least, controller, b: int, k_ref: int = 3) -> float | None:
    """The most any choice of draft length (per step or per row) could gain over fixed ``k_ref`` at
    batch ``b``, under the costs ``controller`` (an adaptive engine's ``DraftLengthController``)
    measured in the same run.

    ``at_least[j]``: the chance that a row's chain accepts more than j drafts, from a fixed k_max run
    (a chain's first positions are accepted at the same rates whatever k is). An oracle that knew
    which drafts will be accepted drafts through the longest chain it wants (K passes of the draft)
    and verifies exactly each row's accepted drafts: a row emits ``1 + a`` tokens from a packed
    verify of ``1 + a`` tokens (and pays no cost of packing). Its rate
    ``b (1 + S_K) / (V(b (1 + S_K)) + P_K(b))``, ``S_K`` the sum of ``at_least`` up to K, maximised
    over K, over fixed k's ``b (1 + S_k) / (V(b (k + 1)) + P_k(b))``, P the controller's own
    proposal costs (``proposal_seconds``). None where the controller has no costs for some K."""

    # the verify forward's cost, a least-squares line through the table's sizes in b..b(K+1): the
    # table's neighbouring entries come from different (rows, k) at different moments and are noisy,
    # and an oracle choosing between sizes a few tokens apart would read that noise as a gain
    pts = {
        n: controller.verify.seconds[n] for n in controller.verify.sizes if b <= n <= b * (len(at_least) + 1)
    }
    if len(pts) < 2:
        return None
    best = oracle_over(at_least, cost_line(pts), controller.proposal_seconds, b, k_ref)
    return None if best is None else best[0]


def cost_line(points: dict[int, float]):
    """Seconds as a function of tokens: the least-squares line through ``points`` (tokens -> seconds)."""
    slope, icpt = np.polyfit(list(points), list(points.values()), 1)
    return lambda n: icpt + slope * n


def oracle_over(at_least, line, proposal, b: int, k_ref: int) -> tuple[float, int] | None:
    """The oracle of :func:`length_policy_ceiling` over fixed ``k_ref`` (0: plain steps) at batch ``b``:
    ``line(tokens)`` the verify forward's seconds, ``proposal(b, k)`` the draft's proposal of k tokens
    (None: not measured). Returns (the ratio, the oracle's best K), or None where a cost is missing."""

    def rate(k, tokens):
        p = proposal(b, k)
        return None if p is None else b * (1 + sum(at_least[:k])) / (line(tokens) + p)

    ref = rate(k_ref, b * (k_ref + 1))
    oracle = {k: rate(k, b * (1 + sum(at_least[:k]))) for k in range(1, len(at_least) + 1)}
    if ref is None or any(r is None for r in oracle.values()):
        return None
    best = max(oracle, key=oracle.__getitem__)
    return oracle[best] / ref, best


def timed_rounds(
    servers: dict, reqs, rounds: int, tag: str, seed: int, prime_seed: int | None = None
) -> dict:
    """Each round runs every server once on ``reqs``, its history emptied first (and, with
    ``prime_seed``, primed by one call on the same prompts: their earlier rollouts); per server the
    rounds' ``(GenerateStats, tail seconds, response lengths)``. A warm-up call per server first (oneDNN
    primitives, the adaptive controllers' tables). The measured calls run as ``run_calls`` runs them."""
    # the warm-up: 2 requests, at most 64 tokens (the long-tail workload's 1024 would cost minutes)
    warm = [dataclasses.replace(q, sampling=dataclasses.replace(q.sampling, max_new_tokens=min(
        64, q.sampling.max_new_tokens))) for q in reqs[:2]]
    for srv in servers.values():
        _reset_history(srv)
        srv.core.generate(warm, seed=99)
    runs: dict = {name: [] for name in servers}
    engines = {name: srv.core for name, srv in servers.items()}
    for r in range(rounds):
        for srv in servers.values():
            _reset_history(srv)
            if prime_seed is not None:  # the step before: the prompts' earlier rollouts
                srv.core.generate(reqs, seed=prime_seed + r)
        calls = {name: (lambda done, c=srv.core, s=seed + r: c.generate_steps(reqs, done, seed=s))
                 for name, srv in servers.items()}
        for name, (samples, st, finish) in run_calls(calls, r, engines).items():
            tail = tail_seconds(finish)
            runs[name].append((st, tail, [len(x.output_ids) for x in samples]))
            print(f"[{tag}] round {r} {name}: {st.tokens_per_s:.1f} tok/s, tail {tail:.2f}s, "
                  f"k_mean {st.k_mean}, sources {st.source_steps}", file=sys.stderr, flush=True)
    return runs


INTERLEAVE = "steps"  # --interleave: how the configs of a round share the machine


def run_calls(calls: dict, turn: int, engines: dict, together: dict | None = None) -> dict:
    """``calls`` (name -> a function of ``on_sample_done`` starting ``generate_steps`` on ``engines[name]``)
    run step by step in turn (``INTERLEAVE`` ``steps``), in waves: calls on one engine (a config at two
    temperatures) never run at once, so they go in successive waves, made in the configs' own order (every
    engine's first config together, whatever the round), each wave's order turned by ``turn`` (a round's
    number: each config leads in turn). ``together``: name -> a key (the config's temperature); configs of
    different keys never share a wave, so the ones a ratio compares run together (until session 54 the
    adaptive T=1 engine, an engine of its own, joined the first wave, beside the greedy configs, a wave apart
    from the T=1 ones its keys are read against). With ``calls``, one whole call after the other in the
    configs' own order, as before. Per name ``(samples, stats, finish times)``, each call's time its own."""
    from _lockstep import run_in_turn

    keys = together or {}
    waves: list[tuple[object, list[str]]] = []
    for name in calls:
        key = keys.get(name)
        free = (w for k, w in waves if k == key and all(engines[n] is not engines[name] for n in w))
        wave = next(free, None)
        if wave is None or INTERLEAVE != "steps":
            waves.append((key, wave := []))
        wave.append(name)
    out = {}
    for _, wave in waves:
        wave = wave[turn % len(wave):] + wave[:turn % len(wave)]
        out.update(run_in_turn({name: calls[name] for name in wave}))
    return {name: out[name] for name in calls}


def grpo_workload(paths, dtype: str, prompts: list[list[int]], new_tokens: int, rounds: int,
                  history_max: int = 10, configs: tuple[str, ...] = GRPO_CONFIGS) -> dict:
    """The GRPO-shaped workload (module docstring) on ``prompts`` (16: the task's, or the real
    model's chat prompts); returns the keys and each config's numbers."""
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    reqs = [GenerateRequest(f"g{i}", p, sp, n=8) for i, p in enumerate(prompts)]
    auto = dict(max_draft_tokens=5)
    plen = _prompt_width(prompts)
    make = {
        "ar": lambda: _server(paths, dtype, "none", 1, 16, new_tokens, plen),
        **{
            f"eagle3_k{k}": (lambda k=k: _server(paths, dtype, "eagle3", k, 16, new_tokens, plen))
            for k in range(2, 6)
        },
        "eagle3_auto": lambda: _server(paths, dtype, "eagle3", "auto", 16, new_tokens, plen, **auto),
        "history_auto": lambda: _server(
            paths, dtype, "history", "auto", 16, new_tokens, plen, max_draft_tokens=history_max
        ),
        "combined": lambda: _server(
            paths,
            dtype,
            "eagle3",
            "auto",
            16,
            new_tokens,
            plen,
            history=True,
            history_max_draft_tokens=history_max,
            **auto,
        ),
        "combined_no_tree": lambda: _server(
            paths,
            dtype,
            "eagle3",
            "auto",
            16,
            new_tokens,
            plen,
            history=True,
            history_max_draft_tokens=history_max,
            history_tree="off",
            **auto,
        ),
    }
    servers = {n: make[n]() for n in make if n in configs}
    runs = timed_rounds(servers, reqs, rounds, "grpo", seed=0, prime_seed=1000)
    stats = {n: [x[0] for x in v] for n, v in runs.items()}
    ceiling = {}
    if "eagle3_k5" in stats and "eagle3_auto" in servers:
        steps = sum(st.spec_steps for st in stats["eagle3_k5"])
        at_least = [sum(st.accepted_at_least[j] for st in stats["eagle3_k5"]) / steps for j in range(5)]
        for b in (16, 8, 4):
            ceiling[b] = length_policy_ceiling(at_least, servers["eagle3_auto"].core.controller, b)
    del servers
    tails = {n: [x[1] for x in v] for n, v in runs.items()}

    def ratio(a, b):
        return paired_ratio(stats[a], stats[b]) if a in stats and b in stats else None

    hist_al = [st.source_accept_length("history") for st in stats.get("combined", [])]
    hist_al = [x for x in hist_al if x is not None]
    fixed = {n: statistics.median(st.tokens_per_s for st in stats[n])
             for n in ("ar", "eagle3_k2", "eagle3_k3", "eagle3_k4", "eagle3_k5") if n in stats}
    best_fixed = max(fixed, key=fixed.__getitem__) if fixed else None
    return {
        "adaptive_over_k3_grpo": ratio("eagle3_auto", "eagle3_k3"),
        "best_fixed_grpo": best_fixed,
        "adaptive_over_best_fixed_grpo": ratio("eagle3_auto", best_fixed),
        "adaptive_over_best_fixed_grpo_interval": (
            paired_ratio_interval(stats["eagle3_auto"], stats[best_fixed])
            if "eagle3_auto" in stats and best_fixed else None
        ),
        "grpo_round_ratios": {
            n: [round(r, 3) for r in round_ratios(stats[n], stats["ar"])]
            for n in stats if n != "ar" and "ar" in stats
        },
        "length_oracle_over_k3_grpo": ceiling.get(16),
        "length_oracle_over_k3_grpo_by_batch": ceiling,
        "history_accept_length_grpo": statistics.median(hist_al) if hist_al else None,
        "history_alone_accept_length_grpo": (
            statistics.median(st.spec_accept_length for st in stats["history_auto"])
            if "history_auto" in stats
            else None
        ),
        "combined_over_eagle3_grpo": ratio("combined", "eagle3_auto"),
        "tree_over_no_tree_grpo": ratio("combined", "combined_no_tree"),
        "tail_speedup_grpo": (
            statistics.median(a / c for a, c in zip(tails["ar"], tails["combined"]))
            if "ar" in tails and "combined" in tails
            else None
        ),
        "grpo_per_config": {
            n: {
                "tokens_per_s": max(st.tokens_per_s for st in v),
                "tail_s": statistics.median(tails[n]),
                "k_mean": v[-1].k_mean,
                "accept_length": v[-1].spec_accept_length,
                "tree_frac": v[-1].source_steps.get("tree", 0) / max(1, sum(v[-1].source_steps.values())),
                "tree_second": v[-1].tree_second,
            }
            for n, v in stats.items()
        },
    }


FRESH_CONFIGS = ("ar", "eagle3_auto", "combined", "combined_no_live")


def length_summary(lengths: list[int]) -> dict:
    """Response lengths of one call: min, median, 90th percentile, max, mean."""
    t = sorted(lengths)
    return {"min": t[0], "p50": t[len(t) // 2], "p90": t[max(0, -(-9 * len(t) // 10) - 1)], "max": t[-1],
            "mean": round(sum(t) / len(t), 1)}


def fresh_workload(paths, dtype: str, prompts: list[list[int]], new_tokens: int, rounds: int,
                   history_max: int = 10, configs: tuple[str, ...] = FRESH_CONFIGS) -> dict:
    """Fresh prompts (issue 31): 16 prompts x 8 samples at T=1 that no call has seen (the history is
    emptied before every call, no priming call), so the finished-response history holds only the
    siblings that finished earlier in the same call, and the live group index what the running
    siblings have written. Configs, interleaved round by round: AR, EAGLE-3 auto, EAGLE-3 + history
    + live group index (``combined``), the same without the live index (``combined_no_live``);
    ``configs`` a subset (keys needing a missing one are None)."""
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    reqs = [GenerateRequest(f"f{i}", p, sp, n=8) for i, p in enumerate(prompts)]
    plen, auto = _prompt_width(prompts), dict(max_draft_tokens=5)
    hist = dict(history=True, history_max_draft_tokens=history_max, **auto)
    make = {"ar": lambda: _server(paths, dtype, "none", 1, 16, new_tokens, plen),
            "eagle3_auto": lambda: _server(paths, dtype, "eagle3", "auto", 16, new_tokens, plen, **auto),
            "combined": lambda: _server(paths, dtype, "eagle3", "auto", 16, new_tokens, plen, **hist),
            "combined_no_live": lambda: _server(paths, dtype, "eagle3", "auto", 16, new_tokens, plen,
                                                history_live=False, **hist)}
    servers = {n: make[n]() for n in make if n in configs}
    runs = timed_rounds(servers, reqs, rounds, "fresh", seed=5000)
    del servers
    stats = {n: [x[0] for x in v] for n, v in runs.items()}
    tails = {n: [x[1] for x in v] for n, v in runs.items()}
    live = [st.source_accepted.get("live", 0) / max(1, st.num_tokens) for st in stats.get("combined", [])]

    def ratio(a, b):
        return paired_ratio(stats[a], stats[b]) if a in stats and b in stats else None

    return {
        "live_history_frac": statistics.median(live) if live else None,
        "combined_over_eagle3_fresh": ratio("combined", "eagle3_auto"),
        "live_over_no_live_fresh": ratio("combined", "combined_no_live"),
        "tail_speedup_fresh": (
            statistics.median(a / c for a, c in zip(tails["ar"], tails["combined"]))
            if "ar" in tails and "combined" in tails
            else None
        ),
        "fresh_new_tokens": new_tokens,
        "fresh_lengths": {n: [length_summary(x[2]) for x in v] for n, v in runs.items()},
        "fresh_per_config": {
            n: {
                "tokens_per_s": max(st.tokens_per_s for st in v),
                "tail_s": statistics.median(tails[n]),
                "accept_length": v[-1].spec_accept_length,
                "source_steps": dict(v[-1].source_steps),
                "source_accept_length": {s: v[-1].source_accept_length(s) for s in v[-1].source_steps},
            }
            for n, v in stats.items()
        },
    }


def run_interleaved(configs: dict, prompts, new_tokens: int, repeats: int = 5) -> dict:
    """``configs``: name -> (server, temperature). Each round runs every config once (``run_calls``:
    step by step together by default); returns each config's runs (``GenerateStats``), round by round.

    Why interleaved: this VM's speed drifts by 10-25% over a minute. Measured one after the
    other, a config that happens to run in a slow minute looks slower than it is, and the
    ratios between configs (what the targets are about) carry that drift. Interleaved, every
    config meets the same drift, and runs of the same round can be compared pairwise.
    """
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    reqs = {t: [GenerateRequest(f"r{i}", p, SamplingParams(temperature=t, max_new_tokens=new_tokens))
                for i, p in enumerate(prompts)] for t in {t for _, t in configs.values()}}
    for server, t in configs.values():
        server.generate(reqs[t][:1])  # warm-up: oneDNN primitives for these shapes
    runs: dict = {name: [] for name in configs}
    engines = {name: srv.core for name, (srv, _) in configs.items()}
    for r in range(repeats):
        # a seed per round, the same for every config: at T=1 a config repeating one seed would time one draw
        # of its sampled texts (their acceptance and lengths) every round, another config other draws
        calls = {name: (lambda done, c=srv.core, q=reqs[t], s=r: c.generate_steps(q, done, seed=s))
                 for name, (srv, t) in configs.items()}
        for name, (_, st, _) in run_calls(calls, r, engines, {n: t for n, (_, t) in configs.items()}).items():
            runs[name].append(st)
    return runs


DRAFT_KINDS = {  # section "drafts": name -> (engine draft_kind, key of the path in paths or None)
    "eagle3": ("eagle3", "eagle3"), "mtp": ("mtp", "mtp"), "draft_model": ("model", "draft_model"),
    "draft_model_distilled": ("model", "draft_model_distilled"), "ngram": ("ngram", None)}


def draft_kinds(paths, dtype: str, prompts, batch: int, new_tokens: int, rounds: int, k: int = 3) -> dict:
    """Every draft kind at ``k`` against plain decoding, greedy and at T=1, in the same rounds: per kind
    its acceptance length and per-position acceptance at each temperature and its paired speed-up
    over AR at the same temperature. Kinds whose draft is missing in ``paths`` are left out."""
    plen = _prompt_width(prompts)
    servers = {"ar": _server(paths, dtype, "none", 1, batch, new_tokens, plen)}
    for name, (kind, key) in DRAFT_KINDS.items():
        if key is None or paths.get(key):
            servers[name] = _server(paths, dtype, kind, k, batch, new_tokens, plen,
                                    draft_path=paths.get(key) if key else None)
    configs = {}
    for name, srv in servers.items():
        configs[name], configs[f"{name}_t1"] = (srv, 0.0), (srv, 1.0)
    runs = run_interleaved(configs, prompts, new_tokens, repeats=rounds)
    out: dict = {
        "ar": max(x.tokens_per_s for x in runs["ar"]),
        "ar_t1": max(x.tokens_per_s for x in runs["ar_t1"]),
    }
    for name in servers:
        if name == "ar":
            continue
        row = {}
        for sfx in ("", "_t1"):
            rs = runs[name + sfx]
            steps = sum(x.spec_steps for x in rs)
            row["tokens_per_s" + sfx] = max(x.tokens_per_s for x in rs)
            row["over_ar" + sfx] = paired_ratio(rs, runs["ar" + sfx])
            row["accept_length" + sfx] = sum(x.spec_accept_length * x.spec_steps for x in rs) / max(steps, 1)
            row["accept_pos" + sfx] = [
                round(
                    sum(x.accepted_at_least[j] for x in rs if len(x.accepted_at_least) > j) / max(steps, 1), 3
                )
                for j in range(k)
            ]
        out[name] = row
    return out


def adaptive_keys(row: dict, runs: dict, fixed: list[str], sfx: str = "") -> str:
    """The adaptive engine (``eagle3_auto`` + ``sfx``) against the fastest of the ``fixed`` configs (k = 0
    and every fixed k, at one temperature) into ``row``: ``adaptive_over_best_fixed``, its 90% interval
    (3 rounds or more), the rounds' ratios and the adaptive engine's k mean, each key with ``sfx``.
    Returns the best fixed config's name."""
    # the fastest by its median round (as the GRPO workload's): at T=1 every round samples other texts, and a
    # config's best round is its luckiest draw
    best = max(fixed, key=lambda n: statistics.median(x.tokens_per_s for x in runs[n]))
    adaptive = (runs["eagle3_auto" + sfx], runs[best])
    row["adaptive_over_best_fixed" + sfx] = paired_ratio(*adaptive)
    row["adaptive_round_ratios" + sfx] = [round(r, 3) for r in round_ratios(*adaptive)]
    interval = paired_ratio_interval(*adaptive)
    if interval is not None:
        row["adaptive_over_best_fixed_interval" + sfx] = interval
    row["k_mean_auto" + sfx] = runs["eagle3_auto" + sfx][-1].k_mean
    return best


def round_ratios(num, den) -> list[float]:
    """``num[r] / den[r]`` per round (tokens/s of two configs in the same round)."""
    return [a.tokens_per_s / b.tokens_per_s for a, b in zip(num, den)]


def paired_ratio(num, den) -> float:
    """Median over rounds of :func:`round_ratios`."""
    return statistics.median(round_ratios(num, den))


def paired_ratio_interval(num, den, level: float = 0.9, draws: int = 4000) -> list[float] | None:
    """A percentile-bootstrap interval (``level``, fixed seed) of :func:`paired_ratio`'s median, resampling
    the rounds: whether a target a few percent from 1 is resolved by this many rounds. None under 3 rounds."""
    ratios = np.array(round_ratios(num, den))
    if len(ratios) < 3:
        return None
    rng = np.random.default_rng(0)
    medians = np.median(ratios[rng.integers(0, len(ratios), (draws, len(ratios)))], axis=1)
    lo, hi = np.quantile(medians, [(1 - level) / 2, (1 + level) / 2])
    return [round(float(lo), 3), round(float(hi), 3)]


def steady_state(paths, dtype: str, batch_sizes, ks, new_tokens: int, tok) -> dict:
    """The simulator's engine-benchmark record (megatron_spec/sim/engine_bench.py): every row
    decodes exactly ``new_tokens`` tokens (EOS ignored, one wave of B requests), so the ratio is
    the steady-state step ratio; v and c measured per k on the same batch."""
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    results = []
    prompt_len = None
    for b in batch_sizes:
        prompts = task_prompts(tok, b, seed=99)
        prompt_len = sum(map(len, prompts)) / len(prompts)
        reqs = [GenerateRequest(f"s{i}", p, sp) for i, p in enumerate(prompts)]
        srv = _server(paths, dtype, "none", 1, b, new_tokens)
        srv.generate(reqs[:1])
        ar = max(srv.generate(reqs)[1].tokens_per_s for _ in range(3))
        del srv
        spec = []
        for k in ks:
            srv = _server(paths, dtype, "eagle3", k, b, new_tokens)
            srv.generate(reqs[:1])
            st = max((srv.generate(reqs)[1] for _ in range(3)), key=lambda x: x.tokens_per_s)
            v, c, _ = forward_costs(srv, b, k)
            spec.append({"k": k, "accept_length": st.spec_accept_length, "tokens_per_s": st.tokens_per_s,
                         "v": v, "c": c})
            del srv
        results.append({"batch_size": b, "ar_tokens_per_s": ar, "spec": spec})
        print(
            f"[steady] {dtype} B={b} ar={ar:.1f} "
            + " ".join(f"k{x['k']}={x['tokens_per_s']:.1f}/{x['accept_length']:.2f}" for x in spec),
            file=sys.stderr,
            flush=True,
        )
    return {
        "hardware": "cpu",
        "model": os.path.join(paths["target"], "config.json"),
        "dtype": dtype,
        "draft_kind": "eagle3",
        "draft_model": None,
        "prompt_len": prompt_len,
        "max_new_tokens": new_tokens,
        "results": results,
    }


def forward_costs(server, batch: int, k: int, reps: int = 10) -> tuple[float, float, float]:
    """(v, c, c_in_loop) on the same batch, each over one AR step.

    v: one target forward over k+1 tokens (a verify). c: one draft step, measured as the
    drafter's whole proposal of k tokens over k: EAGLE-3 fuses the aux states (fc) and runs the
    draft layer over them once, then k-1 more passes, plus the embedding lookups, the argmax
    (greedy, as the workload) and the d2t map of each token; proposals run back to back (the
    draft's weights stay warm). c_in_loop: the same proposal right after a verify forward (whose
    weights evict the draft's from the caches), as the engine runs it. Each of ``reps``
    repetitions times all of them in turn (fastest of 3 calls each); the costs are the medians
    of the repetitions' ratios, paired like the engine runs (a slow moment slows both sides)."""
    from measure_cpu_profile import best_time
    from megatron_spec.speculative import SamplingTensors

    model, drafter = server.target, server.drafter
    cache = model.new_cache(batch, 128)
    pos1 = torch.full((batch, 1), 64)
    posk = 64 + torch.arange(k + 1).expand(batch, k + 1)
    vocab = model.cfg.vocab_size
    ids1 = torch.randint(4, vocab, (batch, 1))
    idsk = torch.randint(4, vocab, (batch, k + 1))
    aux = drafter.aux_layers

    def fastest(fn) -> float:
        return best_time(fn, repeats=3, warmup=0)

    with torch.inference_mode():
        # the drafter's state for `batch` rows at position 64, each with one pending (token, aux)
        # pair: what a verify step leaves when it accepted nothing (the extend runs over one pair)
        drafter.allocate(batch, 128)
        _, aux_states = model(idsk, posk, cache, posk[:, -1] + 1, aux_layers=aux)
        for slot in range(batch):
            drafter.start(slot, [0], int(ids1[slot, 0]), aux_states[slot, -1])
        tokens = [[int(t)] for t in ids1[:, 0]]
        greedy = SamplingTensors.from_values(0.0, batch_size=batch)
        gen = torch.Generator().manual_seed(0)

        def propose():
            drafter.cache.lens[:batch] = 64  # the same positions every time
            drafter.propose(tokens, k, greedy, gen)

        step = lambda: model(ids1, pos1, cache, pos1[:, 0] + 1)
        verify = lambda: model(idsk, posk, cache, posk[:, -1] + 1, aux_layers=aux)
        for fn in (step, verify, propose, step, verify, propose):  # warm-up
            fn()
        v, c, c_loop = [], [], []
        for _ in range(reps):
            ar = fastest(step)
            v.append(fastest(verify) / ar)
            c.append(fastest(propose) / k / ar)
            in_loop = float("inf")
            for _ in range(3):
                verify()
                t0 = time.perf_counter()
                propose()
                in_loop = min(in_loop, (time.perf_counter() - t0) / k)
            c_loop.append(in_loop / ar)
    return statistics.median(v), statistics.median(c), statistics.median(c_loop)


def hf_generate(path: str, dtype: str, prompts, new_tokens: int, assistant: str | None = None) -> float:
    import transformers

    torch_dtype = getattr(torch, dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    kw = {}
    if assistant is not None:
        kw["assistant_model"] = transformers.AutoModelForCausalLM.from_pretrained(
            assistant, dtype=torch_dtype
        ).eval()
    eos = model.generation_config.eos_token_id
    sample = assistant is None
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(
            ids[:1], attention_mask=attn[:1], do_sample=sample, max_new_tokens=4, pad_token_id=0, **kw
        )
        t0 = time.perf_counter()
        out = model.generate(
            ids, attention_mask=attn, do_sample=sample, max_new_tokens=new_tokens, pad_token_id=0, **kw
        )
        seconds = time.perf_counter() - t0
    tokens = 0
    for row in out[:, width:].tolist():
        tokens += row.index(eos) + 1 if eos in row else len(row)
    return tokens / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="small trained base model (default: train one here)")
    ap.add_argument(
        "--model",
        default=None,
        help="a real model instead of the widened small one: smollm2 or a Hub id (megatron-spec "
        "fetch-model); its chat prompts, its EAGLE-3 draft (--draft, or trained here) and its first "
        "--draft-layers layers as the draft model (benchmarks/_real_model.py)",
    )
    ap.add_argument("--draft", default=None, help="with --model: its ModelOpt EAGLE-3 export")
    ap.add_argument(
        "--draft-layers", type=int, default=4, help="with --model: layers of the truncated draft model"
    )
    ap.add_argument(
        "--mtp",
        default=None,
        help="with --model: an MTP export of it (make_draft.py --draft-kind mtp); "
        "section drafts makes one when not given",
    )
    ap.add_argument(
        "--draft-model",
        default=None,
        help="with --model: a distilled draft model (make_draft.py --draft-kind model); section drafts "
        "makes one when not given",
    )
    ap.add_argument("--dtypes", default="auto,float32",
                    help="engine dtypes to measure (auto | float32 | bfloat16), resolved for this CPU")
    ap.add_argument("--batch-sizes", default=None, help="default 1,4,16 (--model: 1,16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 96 (--model: 64)")
    ap.add_argument(
        "--ks", default=None, help="EAGLE-3 k values of the table: default 1,2,3,4,5 (--model: 3)"
    )
    ap.add_argument("--sft-steps", type=int, default=500)
    ap.add_argument("--eagle-steps", type=int, default=300)
    ap.add_argument(
        "--prompts-per-row", type=int, default=2, help="requests per batch slot (continuous batching)"
    )
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_rollout"))
    ap.add_argument(
        "--steady-state-out",
        default=None,
        help="also write the simulator's engine-benchmark JSON here (dtype auto, fixed 64-token rows)",
    )
    ap.add_argument("--steady-only", action="store_true", help="only the steady-state measurement")
    ap.add_argument(
        "--sections",
        default="main,grpo",
        help="what to measure: main (the batch-size table), grpo, fresh (the GRPO workload on prompts "
        "never seen: the live group index), drafts (--model: every draft kind at k=3, greedy and "
        "T=1, batch 1)",
    )
    ap.add_argument("--grpo-new-tokens", type=int, default=None, help="default 128 (--model: 64)")
    ap.add_argument("--grpo-rounds", type=int, default=None, help="default 3 (--model: 2)")
    ap.add_argument(
        "--grpo-task",
        default="sum_long",
        help="task of the GRPO workload and of its own models (in WORK_DIR/models_TASK): sum_long "
        "(2..12 terms) gives the varied response lengths of an RL batch and its long tail",
    )
    ap.add_argument("--grpo-history-max", type=int, default=10,
                    help="longest history proposal (history alone: its k_max; beside EAGLE-3: "
                         "history_max_draft_tokens)")
    ap.add_argument(
        "--grpo-configs",
        default=None,
        help="configs of the GRPO workload to run (keys needing a missing one are null); default all "
        "(--model: ar,eagle3_k3,eagle3_auto,combined)",
    )
    ap.add_argument(
        "--fresh-new-tokens",
        type=int,
        default=None,
        help="longest response of the fresh workload (default --grpo-new-tokens); 1024 with "
        "--fresh-templates asking for reasoning gives the long tail of issue 31 (64-1024 tokens)",
    )
    ap.add_argument(
        "--fresh-templates",
        default=None,
        help="with --model: prompt templates of the fresh workload's questions, separated by '||' and "
        "taken in turn ({prompt}: the question), e.g. '{prompt}||{prompt} Explain every step of your "
        "reasoning.': half short answers, half long reasoning (the long tail)",
    )
    ap.add_argument("--fresh-configs", default=",".join(FRESH_CONFIGS),
                    help="configs of the fresh workload to run (keys needing a missing one are null)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparisons")
    ap.add_argument("--adaptive-t1", action=argparse.BooleanOptionalAction, default=True,
                    help="the batch-size table's adaptive engine at T=1 too, against every fixed k sampled "
                    "(keys *_t1; default on)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="round-robin rounds of the batch-size table (default 5, --model: 3)",
    )
    ap.add_argument("--interleave", choices=("steps", "calls"), default="steps",
                    help="how a round's configs share the machine: step by step in turn, each timed by "
                    "its own steps (default), or one whole call after the other")
    args = ap.parse_args()
    global INTERLEAVE
    INTERLEAVE = args.interleave
    real = args.model is not None
    for name, small, big in (
        ("batch_sizes", "1,4,16", "1,16"),
        ("new_tokens", 96, 64),
        ("ks", "1,2,3,4,5", "3"),
        ("grpo_new_tokens", 128, 64),
        ("grpo_rounds", 3, 2),
        ("rounds", 5, 3),
        ("grpo_configs", ",".join(GRPO_CONFIGS), "ar,eagle3_k3,eagle3_auto,combined"),
    ):
        if getattr(args, name) is None:
            setattr(args, name, big if real else small)
    torch.set_num_threads(2)
    from transformers import AutoTokenizer

    if real:
        from _real_model import chat_prompts, real_model_paths

        paths = real_model_paths(args.model, args.work_dir, args.draft, args.draft_layers, args.eagle_steps,
                                 mtp=args.mtp, draft_model=args.draft_model,
                                 other_kinds="drafts" in args.sections.split(","))
        tok = AutoTokenizer.from_pretrained(paths["target"])
        make_prompts = lambda n, seed, templates=None: chat_prompts(tok, args.work_dir, n, seed, templates)
    else:
        paths = build_models(
            os.path.join(args.work_dir, "models"), args.base, args.sft_steps, args.eagle_steps
        )
        tok = AutoTokenizer.from_pretrained(paths["target"])
        make_prompts = lambda n, seed, templates=None: task_prompts(tok, n, seed)

    ks = [int(x) for x in args.ks.split(",")]
    from megatron_spec._ext import cpu_facts
    from megatron_spec.isa import probe, resolve_dtype

    main_dtype = resolve_dtype("auto")
    dtypes = list(dict.fromkeys(resolve_dtype(d.strip()) for d in args.dtypes.split(",")))
    print(f"[bench_rollout] CPU {probe().model} ({probe().capability}): dtypes {dtypes}", file=sys.stderr)
    if args.steady_state_out or args.steady_only:
        record = steady_state(paths, main_dtype, [int(x) for x in args.batch_sizes.split(",")], ks, 64, tok)
        out = args.steady_state_out or os.path.join(args.work_dir, "engine_bench.json")
        with open(out, "w") as f:
            f.write(json.dumps(record) + "\n")  # one line: the simulator reads the last line
        print(f"[steady] wrote {out}", file=sys.stderr)
        if args.steady_only:
            return 0
    results: dict = {}
    best_fixed_name: dict = {}
    sections = set(args.sections.split(","))
    def workload(seed: int, templates: list[str] | None = None):
        """Paths and 16 prompts of a GRPO-shaped workload: the real model's chat prompts (``templates``
        around the questions in turn), or the task's on its own models (``--grpo-task``)."""
        if real:
            return paths, make_prompts(16, seed, templates)
        wpaths = paths if args.grpo_task == "sum" else build_models(
            os.path.join(args.work_dir, f"models_{args.grpo_task}"), None, args.sft_steps, args.eagle_steps,
            task=args.grpo_task)
        return wpaths, task_prompts(
            AutoTokenizer.from_pretrained(wpaths["target"]), 16, seed, task=args.grpo_task
        )

    grpo = {}
    if "grpo" in sections:
        wpaths, wprompts = workload(2718)
        grpo = grpo_workload(wpaths, main_dtype, wprompts, args.grpo_new_tokens, args.grpo_rounds,
                             args.grpo_history_max, tuple(args.grpo_configs.split(",")))
    fresh = {}
    if "fresh" in sections:
        wpaths, wprompts = workload(3141, args.fresh_templates.split("||") if args.fresh_templates else None)
        fresh = fresh_workload(wpaths, main_dtype, wprompts, args.fresh_new_tokens or args.grpo_new_tokens,
                               args.grpo_rounds, args.grpo_history_max, tuple(args.fresh_configs.split(",")))
    drafts = {}
    if "drafts" in sections:
        if not real:
            ap.error("--sections drafts needs --model (the real model's MTP and distilled drafts)")
        drafts = draft_kinds(paths, main_dtype, make_prompts(2, 4242), 1, args.new_tokens, args.rounds)
        print(
            "drafts B=1: "
            + json.dumps(
                {
                    n: {a: v if not isinstance(v, float) else round(v, 3) for a, v in r.items()}
                    if isinstance(r, dict)
                    else round(r, 2)
                    for n, r in drafts.items()
                }
            ),
            file=sys.stderr,
            flush=True,
        )
    for dtype in (dtypes if "main" in sections else []):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            prompts = make_prompts(b * args.prompts_per_row, 4242)
            plen = _prompt_width(prompts)
            row: dict = {}
            servers = {"ar": _server(paths, dtype, "none", 1, b, args.new_tokens, plen)}
            servers.update(
                {f"eagle3_k{k}": _server(paths, dtype, "eagle3", k, b, args.new_tokens, plen) for k in ks}
            )
            servers["eagle3_auto"] = _server(paths, dtype, "eagle3", "auto", b, args.new_tokens, plen,
                                             max_draft_tokens=max(ks))
            servers.update(
                {
                    kind: _server(paths, dtype, kind, 3, b, args.new_tokens, plen)
                    for kind in ("model", "ngram")
                }
            )
            configs = {name: (srv, 0.0) for name, srv in servers.items()}
            configs["ar_sampling"] = (servers["ar"], 1.0)
            sampled = [f"eagle3_k{k}" for k in ks] if args.adaptive_t1 else ["eagle3_k3"] * (3 in ks)
            for name in sampled:  # acceptance at the RL sampling temperature
                configs[f"{name}_t1"] = (servers[name], 1.0)
            if args.adaptive_t1:  # its own engine: the controller learns T=1's acceptance, not greedy's
                configs["eagle3_auto_t1"] = (_server(paths, dtype, "eagle3", "auto", b, args.new_tokens, plen,
                                                     max_draft_tokens=max(ks)), 1.0)
            runs = run_interleaved(configs, prompts, args.new_tokens, repeats=args.rounds)
            k3_over_ar = paired_ratio(runs["eagle3_k3"], runs["ar"])
            best_fixed_name[f"{dtype}_b{b}"] = adaptive_keys(row, runs, ["ar", *[f"eagle3_k{k}" for k in ks]])
            if args.adaptive_t1:
                best_fixed_name[f"{dtype}_b{b}_t1"] = adaptive_keys(
                    row, runs, ["ar_sampling", *[f"eagle3_k{k}_t1" for k in ks]], "_t1"
                )
            if "model" in runs:
                row["model_k3_over_ar"] = paired_ratio(runs["model"], runs["ar"])
            for name, rounds in runs.items():
                st = max(rounds, key=lambda x: x.tokens_per_s)
                row[name] = st.tokens_per_s
                if name.startswith("eagle3_k"):
                    row[f"accept_k{name[len('eagle3_k'):]}"] = st.spec_accept_length
                    # per position: the share of verify steps accepting >= j+1
                    if name.startswith("eagle3_k3"):
                        steps = sum(x.spec_steps for x in rounds)
                        row[f"accept_pos_k{name[len('eagle3_k') :]}"] = [
                            round(sum(x.accepted_at_least[j] for x in rounds) / max(steps, 1), 3)
                            for j in range(3)
                        ]
                elif name in ("model", "ngram"):
                    row[f"accept_{name}"] = st.spec_accept_length
            if "eagle3_k3" in servers:
                row["v"], row["c"], row["c_in_loop"] = forward_costs(servers["eagle3_k3"], b, 3)
            del servers, configs, runs
            if not args.no_hf:
                row["hf_generate"] = hf_generate(paths["target"], dtype, prompts[:b], args.new_tokens)
            if b == 1 and not args.no_hf:
                row["hf_assisted"] = hf_generate(paths["target"], dtype, prompts[:1], args.new_tokens,
                                                 assistant=paths["draft_model"])
            tau = row["accept_k3"]
            row["ceiling_k3"] = tau / (row["v"] + 3 * row["c"])
            row["eagle3_k3_over_ar"] = k3_over_ar
            row["fraction_of_ceiling_k3"] = row["eagle3_k3_over_ar"] / row["ceiling_k3"]
            row["ceiling_k3_in_loop"] = tau / (row["v"] + 3 * row["c_in_loop"])
            row["fraction_of_ceiling_k3_in_loop"] = row["eagle3_k3_over_ar"] / row["ceiling_k3_in_loop"]
            results[f"{dtype}_b{b}"] = row
            print(f"{dtype} B={b}: " + ", ".join(f"{k}={v}" if isinstance(v, list) else f"{k}={v:.3g}"
                                                 for k, v in row.items()), file=sys.stderr, flush=True)

    # table
    cols = [
        "ar",
        "ar_sampling",
        *[f"eagle3_k{k}" for k in ks],
        *[f"eagle3_k{k}_t1" for k in ks],
        "eagle3_auto",
        "eagle3_auto_t1",
        "model",
        "ngram",
        "hf_generate",
        "hf_assisted",
    ]
    print(
        f"{'config':<14}"
        + "".join(f"{c:>13}" for c in cols)
        + f"{'tau_k3':>8}{'v':>6}{'c':>6}{'ceil':>6}{'frac':>6}"
        + f"{'c_loop':>8}{'ceil_l':>8}{'frac_l':>8}"
    )
    for key, row in results.items():
        print(
            f"{key:<14}"
            + "".join(f"{row.get(c, float('nan')):>13.1f}" for c in cols)
            + f"{row['accept_k3']:>8.2f}{row['v']:>6.2f}{row['c']:>6.2f}{row['ceiling_k3']:>6.2f}"
            + f"{row['fraction_of_ceiling_k3']:>6.2f}"
            f"{row['c_in_loop']:>8.3f}{row['ceiling_k3_in_loop']:>8.2f}"
            + f"{row['fraction_of_ceiling_k3_in_loop']:>8.2f}"
        )
    print("acceptance lengths: " + json.dumps({k: {a: v if isinstance(v, list) else round(v, 2)
                                                  for a, v in r.items() if a.startswith("accept")}
                                              for k, r in results.items()}))
    main_dtype = main_dtype if main_dtype in dtypes else dtypes[0]
    b1, b16 = results.get(f"{main_dtype}_b1"), results.get(f"{main_dtype}_b16")  # None: batch not measured
    rnd = lambda x: None if x is None else round(x, 3)
    mine = [r for k, r in results.items() if k.startswith(f"{main_dtype}_")]
    summary = {
        "real_model": os.path.basename(os.path.normpath(paths["target"])) if real else None,
        "ar_over_hf_generate_b1": rnd(b1["ar_sampling"] / b1["hf_generate"])
        if b1 and "hf_generate" in b1
        else None,
        "eagle3_k3_over_ar_b16": rnd(b16["eagle3_k3_over_ar"]) if b16 else None,
        "eagle3_accept_length_k3_t1": rnd(
            statistics.median(r["accept_k3_t1"] for r in mine if "accept_k3_t1" in r)
        )
        if any("accept_k3_t1" in r for r in mine)
        else None,
        "eagle3_k3_over_ar_b1": rnd(b1["eagle3_k3_over_ar"]) if b1 else None,
        "accept_length_k3_b1": rnd(b1["accept_k3"]) if b1 else None,
        "fraction_of_ceiling_k3_min": rnd(min(r["fraction_of_ceiling_k3"] for r in results.values()))
        if results
        else None,
        "fraction_of_ceiling_k3_min_in_loop": rnd(
            min(r["fraction_of_ceiling_k3_in_loop"] for r in results.values())
        )
        if results
        else None,
        "ar_over_hf_generate_b16": rnd(b16["ar_sampling"] / b16["hf_generate"])
        if b16 and "hf_generate" in b16
        else None,
        "eagle3_k3_over_hf_assisted_b1": rnd(b1["eagle3_k3"] / b1["hf_assisted"])
        if b1 and "hf_assisted" in b1
        else None,
        **{
            f"adaptive_over_best_fixed{sfx}_min": rnd(min(r[f"adaptive_over_best_fixed{sfx}"] for r in mine))
            if any(f"adaptive_over_best_fixed{sfx}" in r for r in mine)
            else None
            for sfx in ("", "_t1")
        },
        "best_fixed": best_fixed_name,
        **{
            f"adaptive_over_best_fixed_interval{sfx}": {
                k: r[f"adaptive_over_best_fixed_interval{sfx}"] for k, r in results.items()
                if f"adaptive_over_best_fixed_interval{sfx}" in r
            }
            for sfx in ("", "_t1")
        },
        "adaptive_over_k3_grpo": rnd(grpo.get("adaptive_over_k3_grpo")),
        "best_fixed_grpo": grpo.get("best_fixed_grpo"),
        "adaptive_over_best_fixed_grpo": rnd(grpo.get("adaptive_over_best_fixed_grpo")),
        "adaptive_over_best_fixed_grpo_interval": grpo.get("adaptive_over_best_fixed_grpo_interval"),
        "grpo_round_ratios": grpo.get("grpo_round_ratios", {}),
        "length_oracle_over_k3_grpo": rnd(grpo.get("length_oracle_over_k3_grpo")),
        "length_oracle_over_k3_grpo_by_batch": {
            b: rnd(v) for b, v in grpo.get("length_oracle_over_k3_grpo_by_batch", {}).items()
        },
        "history_accept_length_grpo": rnd(grpo.get("history_accept_length_grpo")),
        "combined_over_eagle3_grpo": rnd(grpo.get("combined_over_eagle3_grpo")),
        "tree_over_no_tree_grpo": rnd(grpo.get("tree_over_no_tree_grpo")),
        "tail_speedup_grpo": rnd(grpo.get("tail_speedup_grpo")),
        "grpo_per_config": {
            n: {a: rnd(v) for a, v in c.items()} for n, c in grpo.get("grpo_per_config", {}).items()
        },
        **{
            k: rnd(fresh.get(k))
            for k in (
                "live_history_frac",
                "combined_over_eagle3_fresh",
                "live_over_no_live_fresh",
                "tail_speedup_fresh",
            )
        },
        "fresh_new_tokens": fresh.get("fresh_new_tokens"),
        "fresh_lengths": fresh.get("fresh_lengths", {}),
        "fresh_per_config": fresh.get("fresh_per_config", {}),
        **{
            f"{name}_accept_length_k3{sfx}": rnd(drafts[name][f"accept_length{sfx}"])
            for name in ("mtp", "draft_model_distilled")
            if name in drafts
            for sfx in ("", "_t1")
        },
        "drafts_b1": {
            n: {a: v if isinstance(v, list) else rnd(v) for a, v in r.items()}
            if isinstance(r, dict)
            else rnd(r)
            for n, r in drafts.items()
        },
        "dtype": main_dtype,
        "interleave": INTERLEAVE,
        **cpu_facts(),
        "per_config": {
            k: {a: v if isinstance(v, list) else round(v, 3) for a, v in r.items() if v is not None}
            for k, r in results.items()
        },
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
