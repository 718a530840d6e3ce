"""The native engine with the heap kept (``megatron_spec.host_memory``) against glibc's default allocator
settings, on the real model, side by side.

    python benchmarks/bench_host_memory.py [--model smollm2] [--dtypes auto,float32] [--batch-sizes 16,64]
        [--rounds 3] [--new-tokens 64]
    python benchmarks/bench_host_memory.py --main-job 5 [--rounds 2]

The allocator's settings are a process's, so each round runs two child processes in turn (their order
alternating round by round), one with ``MEGATRON_SPEC_DEFAULT_MALLOC=1`` (glibc's defaults) and one
without (the engine keeps its heap, as it does in every run). Each child, per dtype and batch size B, builds a
plain-decoding engine (``EngineServer``, as ``bench_vs_vllm.py`` builds ours) and times:

* ``prefill``: the target's forward over B chat prompts (``CausalLM.forward`` on the engine's cache, logits at
  the prompts' last positions), the median of 3 after one;
* ``decode``: a decode forward of B rows after those prompts, the median of 12 after 3;
* ``call``: ``generate`` of the B prompts, ``--new-tokens`` greedy tokens each (EOS respected), tokens/s, the
  best of 2 calls after a warm-up call; and over those 2 calls, per call, the process's minor page faults,
  its kernel (sys) CPU seconds and all its CPU seconds (``getrusage``): what the allocator's settings change
  directly, and counted, not timed, so this VM's drift does not move the faults.

``--main-job STEPS`` instead runs the main job (``launch/pretrain_grpo_spec.py``, ``smollm2_algebra.yaml``,
plain rollouts, STEPS steps) once per configuration and round, the order alternating, its trainer and engine
both following the switch, and reads the trainer process's counters from ``/proc`` as each step's metrics row
appears (``_grpo_runs.run_grpo`` polls every second): keys ``trainer_faults_per_step_{kept,default}``,
``trainer_sys_s_per_step_*`` (medians over the steps after the first), ``trainer_rss_mb_*`` (the metrics'
``mem/rss_mb``, median after the first step) and ``kept_over_default_{train,logprob,step}`` (the median over
rounds of the default run's mean stage time over the kept run's, steps after the first).

Keys, each ``_{dtype}_b{B}``: ``kept_over_default_{prefill,decode,call}`` (the median over rounds of the
kept process's speed over the default one's in the same round), ``kept_over_default_cpu`` (the same of CPU
seconds a call: default over kept), ``faults_per_call_{kept,default}`` and ``sys_s_per_call_{kept,default}``
(medians); the CPU kind and the linear kernels.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

DECODE_FORWARDS = 15
"""Decode forwards :func:`forward_seconds` runs after the prompts (the first 3 not counted): room the
engine's context must have beyond the longest prompt."""


def forward_seconds(model, cache, prompts: list[list[int]]) -> tuple[float, float]:
    """A prefill of ``prompts`` (median of 3 after one) and a decode forward after them (median of 12
    after 3), seconds, on ``cache`` (the engine's own)."""
    import torch

    from megatron_spec.rollout.native.rows import pad_rows

    b, width = len(prompts), max(map(len, prompts))
    ids, pos = pad_rows(prompts, width, 0, "cpu"), torch.arange(width).expand(b, width)
    lens = torch.tensor([len(p) for p in prompts])

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    with torch.inference_mode():
        pre = [timed(lambda: model.forward(ids, pos, cache, lens, logits_index=(lens - 1)[:, None]))
               for _ in range(4)][1:]
        dec = [timed(lambda j=j: model.forward(ids[:, :1], (lens + j)[:, None], cache, lens + j + 1))
               for j in range(DECODE_FORWARDS)][3:]
    return statistics.median(pre), statistics.median(dec)


def child(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from _real_model import chat_prompts
    from megatron_spec import host_memory
    from megatron_spec.isa import resolve_dtype
    from megatron_spec.models.fetch import resolve_model
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    torch.set_num_threads(2)
    target = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(target)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    out: dict = {}
    for dtype in dict.fromkeys(resolve_dtype(d) for d in args.dtypes.split(",")):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            prompts = chat_prompts(tok, args.work_dir, b, 4242)
            srv = EngineServer(EngineConfig(model_path=target, draft_kind="none", dtype=dtype,
                                            max_batch_size=b, num_threads=2,
                                            context_length=max(32, max(map(len, prompts)))
                                            + max(args.new_tokens, DECODE_FORWARDS)))
            prefill_s, decode_s = forward_seconds(srv.core.model, srv.core.cache, prompts)
            reqs = [GenerateRequest(f"r{i}", p, greedy) for i, p in enumerate(prompts)]
            srv.generate(reqs)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            calls = [srv.core.generate(reqs, seed=0)[1].tokens_per_s for _ in range(2)]
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            out[f"{dtype}_b{b}"] = dict(
                prefill_s=prefill_s, decode_s=decode_s, call_tokens_per_s=max(calls),
                faults_per_call=(r1.ru_minflt - r0.ru_minflt) / 2,
                sys_s_per_call=(r1.ru_stime - r0.ru_stime) / 2,
                cpu_s_per_call=(r1.ru_stime + r1.ru_utime - r0.ru_stime - r0.ru_utime) / 2)
            del srv
    out["host_memory"] = host_memory.state()
    return out


def alternated(rounds: int):
    """``(round, mode, environment)`` for each child run: ``kept`` and ``default`` (the switch set), their
    order alternating round by round."""
    from megatron_spec.host_memory import DEFAULT_MALLOC_ENV

    for r in range(rounds):
        for mode in (("kept", "default") if r % 2 == 0 else ("default", "kept")):
            env = {k: v for k, v in os.environ.items() if k != DEFAULT_MALLOC_ENV}
            if mode == "default":
                env[DEFAULT_MALLOC_ENV] = "1"
            yield r, mode, env


def trainer_counters() -> tuple[int, float, float] | None:
    """The running main job's trainer process (not torchrun's): its minor page faults, kernel and user CPU
    seconds so far (``/proc/PID/stat``); None where there is none."""
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read()
            if "pretrain_grpo_spec.py" in cmd and "torch.distributed.run" not in cmd:
                with open(f"/proc/{pid}/stat") as f:
                    st = f.read().rsplit(")", 1)[1].split()  # fields 3.. of proc(5)
                return int(st[7]), int(st[12]) / tick, int(st[11]) / tick  # minflt, stime, utime
        except OSError:  # the process ended meanwhile
            continue
    return None


def main_job(args) -> dict:
    """``--main-job``: the trainer's counters and stage times, kept against default (module docstring)."""
    from _grpo_runs import grpo_cmd, mean, run_grpo
    from _real_model import MODULES, questions
    from megatron_spec.models.fetch import resolve_model

    target = resolve_model(args.model)
    questions(args.work_dir, "train-easy")
    data = ("--prompt-data", os.path.join(args.work_dir, "math_task", MODULES, "train-easy.jsonl"))
    config = os.path.join(ROOT, "launch", "configs", "smollm2_algebra.yaml")
    runs: dict[str, list[tuple[list, list]]] = {"kept": [], "default": []}
    for r, mode, env in alternated(args.rounds):
        run_dir = os.path.join(args.work_dir, f"host_memory_{mode}")
        cmd = grpo_cmd(run_dir, target, args.main_job, draft_kind="none", config=config, port=29641,
                       extra=data)
        marks: list = []  # the trainer's counters as each step's metrics row appears (None: it had ended)
        rows = run_grpo(cmd, run_dir, "host_memory", env=env,
                        on_step=lambda row, m=marks: m.append(trainer_counters()))
        shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoint and HF export: 2 GB a run
        counters = [tuple(y - x for x, y in zip(a, b)) for a, b in zip(marks, marks[1:]) if a and b]
        runs[mode].append((rows, counters))
        print(f"[host_memory] round {r} {mode}: per step (faults, sys s, user s) "
              f"{[(f, round(s_, 2), round(u, 1)) for f, s_, u in counters]}, train "
              f"{[round(x['time/train'], 2) for x in rows]}, rss_mb {[round(x['mem/rss_mb']) for x in rows]}",
              file=sys.stderr, flush=True)
    out: dict = {"main_job_steps": args.main_job}
    for mode, got in runs.items():
        out[f"trainer_faults_per_step_{mode}"] = statistics.median(c[0] for _, cs in got for c in cs)
        out[f"trainer_sys_s_per_step_{mode}"] = round(statistics.median(c[1] for _, cs in got for c in cs), 3)
        rss = [x["mem/rss_mb"] for rows, _ in got for x in rows[1:]]
        out[f"trainer_rss_mb_{mode}"] = round(statistics.median(rss))
    for stage in ("train", "logprob", "step"):
        ratios = [mean([x[f"time/{stage}"] for x in d[1:]]) / mean([x[f"time/{stage}"] for x in k[1:]])
                  for (k, _), (d, _) in zip(runs["kept"], runs["default"])]
        out[f"kept_over_default_{stage}"] = round(statistics.median(ratios), 3)
        out[f"kept_over_default_{stage}_rounds"] = [round(x, 3) for x in ratios]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", default="auto,float32")
    ap.add_argument("--batch-sizes", default="16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_rollout"))
    ap.add_argument("--main-job", type=int, default=0, metavar="STEPS",
                    help="the main job's trainer instead of the engine (module docstring)")
    ap.add_argument("--child", choices=("kept", "default"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("CHILD " + json.dumps(child(args)), flush=True)
        return 0
    from megatron_spec._ext import cpu_facts

    if args.main_job:
        if args.main_job < 2:
            ap.error("--main-job needs 2 steps or more (the first is not counted)")
        facts = cpu_facts()
        facts = {k: facts[k] for k in ("cpu_kind", "cpu_model")}
        print(json.dumps({**facts, "rounds": args.rounds, **main_job(args)}))
        return 0
    runs: dict[str, list[dict]] = {"kept": [], "default": []}
    for r, mode, env in alternated(args.rounds):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model", args.model,
               "--dtypes", args.dtypes, "--batch-sizes", args.batch_sizes, "--new-tokens",
               str(args.new_tokens), "--work-dir", args.work_dir]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("CHILD ")), None)
        if proc.returncode or line is None:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"the {mode} child failed (rc {proc.returncode})")
        res = json.loads(line[len("CHILD "):])
        expected = "kept" if mode == "kept" else "default asked"
        if res["host_memory"] != expected:
            raise SystemExit(f"the {mode} child's allocator: {res['host_memory']}, expected {expected}")
        runs[mode].append(res)
        print(f"[host_memory] round {r} {mode}: " + json.dumps(
            {k: {a: round(v, 4) for a, v in x.items()} for k, x in res.items() if isinstance(x, dict)}),
            file=sys.stderr, flush=True)
    facts = cpu_facts()
    result: dict = {"cpu_kind": facts["cpu_kind"], "cpu_model": facts["cpu_model"],
                    "linear_kernel": facts["linear_kernel"], "rounds": args.rounds}
    for cfg in (k for k in runs["kept"][0] if k != "host_memory"):
        for key, speed in (("prefill", lambda x: 1 / x["prefill_s"]), ("decode", lambda x: 1 / x["decode_s"]),
                           ("call", lambda x: x["call_tokens_per_s"])):
            ratios = [speed(k[cfg]) / speed(d[cfg]) for k, d in zip(runs["kept"], runs["default"])]
            result[f"kept_over_default_{key}_{cfg}"] = round(statistics.median(ratios), 3)
            result[f"kept_over_default_{key}_{cfg}_rounds"] = [round(x, 3) for x in ratios]
        cpu = [d[cfg]["cpu_s_per_call"] / k[cfg]["cpu_s_per_call"]
               for k, d in zip(runs["kept"], runs["default"])]
        result[f"kept_over_default_cpu_{cfg}"] = round(statistics.median(cpu), 3)
        for mode in ("kept", "default"):
            for key in ("faults_per_call", "sys_s_per_call"):
                result[f"{key}_{mode}_{cfg}"] = round(statistics.median(x[cfg][key] for x in runs[mode]), 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
