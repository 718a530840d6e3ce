"""A behaviour snapshot for refactors: run fixed GRPO and generate jobs on the test models and record
hashes of what they produced (rollouts, checkpoint tensors, metrics without timings, generated
samples); compare two snapshots (e.g. before and after a redesign, each taken in its own checkout).

    python -m tests.model_factory /tmp/models                 # once (deterministic models)
    python scripts/behaviour_snapshot.py run /tmp/snap_before --models /tmp/models   # in the old checkout
    python scripts/behaviour_snapshot.py run /tmp/snap_after --models /tmp/models    # in the new one
    python scripts/behaviour_snapshot.py compare /tmp/snap_before /tmp/snap_after

The jobs (CPU, gloo; ~5 min on 2 cores): GRPO with EAGLE-3 online training at T=1 with held-out
evaluation; async policy lag 1; 2 ranks DP with online MTP and a KL reference; TP 2 with n-gram
drafts at T=0.7, top-k 8; and ``megatron-spec generate`` with every fixed-k drafter at T=0 and 1.
Adaptive k chooses from measured times, so its rollouts differ run to run; the ``adaptive`` job runs it
on a fake clock (every ``time.perf_counter`` call 1 ms later than the last), which makes its plans, and
so its outputs and its decision trace, a function of the code alone: adaptive k with EAGLE-3, the
history drafter alone, EAGLE-3 and a draft model beside the history (mixed, history-only and tree steps).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("time/", "mem/", "gen/", "sync/seconds", "draft/train_seconds", "draft/export_seconds", "capture/",
          "rollout/imbalance")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grpo(out: str, name: str, models: dict, nproc: int, *extra: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={_port()}",
        os.path.join(ROOT, "launch", "pretrain_grpo_spec.py"),
        "--hf-checkpoint",
        models["target"],
        "--prompt-data",
        "synthetic:sum",
        "--reward",
        "tests.rl.rewards_for_tests:digit_share",
        "--make-vocab-size-divisible-by",
        "8",
        "--prompts-per-step",
        "4",
        "--grpo-group-size",
        "2",
        "--micro-batch-size",
        "4",
        "--rollout-max-new-tokens",
        "12",
        "--rollout-max-batch-size",
        "8",
        "--rollout-num-threads",
        "1",
        "--lr",
        "1e-3",
        "--quiet",
        "--tensorboard-dir",
        "none",
        "--train-iters",
        "3",
        "--save-interval",
        "3",
        "--dump-rollouts",
        "--save",
        os.path.join(out, name),
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"{name} failed: see {out}/{name}.log")


def _generate(out: str, models: dict) -> None:
    rnd = random.Random(0)
    prompts = os.path.join(out, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(12):
            f.write(
                json.dumps({"id": f"p{i}", "input_ids": [rnd.randrange(4, 80) for _ in range(5 + i % 4)]})
                + "\n"
            )
    drafts = {
        "eagle3": ["--draft-kind", "eagle3", "--draft-path", models["eagle3"], "--num-draft-tokens", "3"],
        "model": ["--draft-kind", "model", "--draft-path", models["draft_model"], "--num-draft-tokens", "3"],
        "ngram": ["--draft-kind", "ngram", "--num-draft-tokens", "2"],
        "history": ["--draft-kind", "history", "--num-draft-tokens", "4"],
        "none": ["--draft-kind", "none"],
    }
    for name, flags in drafts.items():
        for t in ("0", "1"):
            path = os.path.join(out, "generate", f"{name}-t{t}.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "megatron_spec",
                    "generate",
                    "--model",
                    models["target"],
                    *flags,
                    "--prompts",
                    prompts,
                    "--n",
                    "4",
                    "--temperature",
                    t,
                    "--max-new-tokens",
                    "24",
                    "--seed",
                    "3",
                    "--batch-size",
                    "8",
                    "--dtype",
                    "float32",
                    "--num-threads",
                    "1",
                    "--ignore-eos",
                    "--output",
                    path,
                    "--no-progress",
                ],
                check=True,
                capture_output=True,
                env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                cwd=ROOT,
            )


ADAPTIVE = {
    "history": dict(draft_kind="history", num_draft_tokens="auto", max_draft_tokens=4),
    "eagle3-auto": dict(draft_kind="eagle3", num_draft_tokens="auto", max_draft_tokens=3),
    "eagle3-auto-history": dict(draft_kind="eagle3", num_draft_tokens="auto", max_draft_tokens=3,
                                history=True, history_max_draft_tokens=6),
    "eagle3-auto-history-tree": dict(draft_kind="eagle3", num_draft_tokens="auto", max_draft_tokens=3,
                                     history=True, history_max_draft_tokens=6),
    "model-auto-history": dict(draft_kind="model", num_draft_tokens="auto", max_draft_tokens=3, history=True,
                               history_max_draft_tokens=6, history_tree="off"),
}


def _adaptive(out: str, models: dict) -> None:
    """Each ``ADAPTIVE`` engine on the fake clock (this process: run with the checkout on PYTHONPATH):
    three rounds of greedy and sampled requests (later rounds: the history holds the earlier answers);
    writes ``adaptive/<name>.json`` (outputs, k and source counts) and ``<name>.trace.json``."""
    import itertools
    import time

    import torch

    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    os.makedirs(os.path.join(out, "adaptive"), exist_ok=True)
    for name, cfg in ADAPTIVE.items():
        if name.endswith("tree"):  # a tree step wherever a row has a history proposal
            os.environ["MEGATRON_SPEC_TEST_HOOKS"] = "history_tree_always"
        trace = os.path.join(out, "adaptive", f"{name}.trace.jsonl")
        if os.path.exists(trace):
            os.remove(trace)
        path = {"eagle3": models["eagle3"], "model": models["draft_model"]}.get(cfg["draft_kind"])
        server = EngineServer(EngineConfig(model_path=models["target"], draft_path=path, context_length=96,
                                           max_batch_size=6, seed=3, spec_trace=trace, **cfg))
        clock, real = itertools.count(), time.perf_counter
        time.perf_counter = lambda clock=clock: next(clock) * 1e-3
        try:
            g = torch.Generator().manual_seed(5)
            results = []
            for rnd in range(3):
                reqs = []
                for i in range(6):
                    prompt = torch.randint(4, 80, (3 + i,), generator=g).tolist() * 2
                    sp = SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=8, top_p=0.9,
                                        max_new_tokens=18 + 3 * i)
                    reqs.append(GenerateRequest(f"r{rnd}_{i}", prompt, sp, n=1 + i % 3))
                samples, stats = server.generate(reqs, seed=rnd)
                results.append([(s.request_id, s.sample_index, s.output_ids) for s in samples])
                results.append({"k_counts": stats.k_counts, "source_steps": stats.source_steps})
        finally:
            time.perf_counter = real
            os.environ.pop("MEGATRON_SPEC_TEST_HOOKS", None)
        with open(os.path.join(out, "adaptive", f"{name}.json"), "w") as f:
            json.dump(results, f)
        with open(trace) as f:
            steps = [{k: v for k, v in json.loads(line).items() if k != "pid"} for line in f]
        with open(os.path.join(out, "adaptive", f"{name}.trace.json"), "w") as f:
            json.dump(steps, f)


def _digest(out: str) -> dict:
    import torch

    res = {}
    for f in sorted(glob.glob(os.path.join(out, "generate", "*.jsonl"))):
        res[f"generate/{os.path.basename(f)}"] = hashlib.sha256(open(f, "rb").read()).hexdigest()[:16]
    for f in sorted(glob.glob(os.path.join(out, "adaptive", "*.json"))):
        res[f"adaptive/{os.path.basename(f)}"] = hashlib.sha256(open(f, "rb").read()).hexdigest()[:16]
    jobs = [d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d))]
    jobs = [d for d in jobs if d not in ("generate", "adaptive")]
    for run in sorted(jobs):
        d = os.path.join(out, run)
        for f in sorted(glob.glob(f"{d}/rollouts/*.jsonl")):
            res[f"{run}/{os.path.basename(f)}"] = hashlib.sha256(open(f, "rb").read()).hexdigest()[:16]
        for f in sorted(glob.glob(f"{d}/iter_*/rank_*.pt")):
            state, h = torch.load(f, weights_only=False), hashlib.sha256()
            for part in ("model", "draft"):
                for n, v in sorted((state.get(part) or {}).items()):
                    if isinstance(v, torch.Tensor):
                        h.update(n.encode())
                        h.update(v.detach().float().numpy().tobytes())
            res[f"{run}/{os.path.relpath(f, d)}"] = h.hexdigest()[:16]
        rows = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
        res[f"{run}/metric_keys"] = sorted({k for r in rows for k in r})
        res[f"{run}/metrics"] = [
            {k: v for k, v in r.items() if not k.startswith(TIMING) and not k.endswith("_s")} for r in rows
        ]
    return res


def run(out: str, models_dir: str) -> None:
    with open(os.path.join(models_dir, "setup.json")) as f:
        models = {k: os.path.join(models_dir, v) for k, v in json.load(f).items()}
    os.makedirs(out, exist_ok=True)
    _grpo(
        out,
        "eagle3_online",
        models,
        1,
        "--spec-draft-kind",
        "eagle3",
        "--spec-draft-path",
        models["eagle3"],
        "--spec-online-draft-training",
        "--rollout-temperature",
        "1.0",
        "--eval-interval",
        "2",
        "--eval-prompts",
        "4",
    )
    _grpo(out, "async_lag1", models, 1, "--spec-draft-kind", "eagle3", "--spec-draft-path", models["eagle3"],
          "--async-policy-lag", "1")
    _grpo(
        out,
        "dp2_mtp",
        models,
        2,
        "--spec-draft-kind",
        "mtp",
        "--spec-online-draft-training",
        "--kl-coef",
        "0.01",
    )
    _grpo(out, "ngram_tp2", models, 2, "--spec-draft-kind", "ngram", "--tensor-model-parallel-size", "2",
          "--rollout-temperature", "0.7", "--rollout-top-k", "8")
    _generate(out, models)
    subprocess.run([sys.executable, os.path.abspath(__file__), "adaptive", out, "--models", models_dir],
                   check=True, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), cwd=ROOT)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(_digest(out), f, indent=1, sort_keys=True)
    print(f"snapshot: {out}/summary.json")


def compare(a: str, b: str) -> int:
    x, y = (json.load(open(os.path.join(p, "summary.json"))) for p in (a, b))
    diffs = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
    for k in diffs:
        print(f"differs: {k}")
    print(f"{len(set(x) | set(y))} entries, {len(diffs)} differ")
    return 1 if diffs else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("--models", required=True, help="folder made by python -m tests.model_factory DIR")
    a = sub.add_parser("adaptive", help="only the adaptive job (run calls it in a process of its own)")
    a.add_argument("out")
    a.add_argument("--models", required=True)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.out, args.models)
        return 0
    if args.cmd == "adaptive":
        with open(os.path.join(args.models, "setup.json")) as f:
            _adaptive(args.out, {k: os.path.join(args.models, v) for k, v in json.load(f).items()})
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    raise SystemExit(main())
