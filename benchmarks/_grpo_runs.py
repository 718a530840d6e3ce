"""What the GRPO benchmarks share: the demo's base policy and ModelOpt draft, and the GRPO run.

* :func:`ensure_models`: the base policy (``launch/sft_base.py``, the demo's settings) and its
  EAGLE-3 draft (``launch/make_draft.py``), made once and cached in a work directory, or the
  directories given;
* :func:`grpo_cmd` / :func:`run_grpo`: one ``launch/pretrain_grpo_spec.py`` run from that base on
  the demo config, its metrics read back (optionally a progress callback per finished step).

Used by ``bench_grpo.py`` (speculation on vs off) and ``bench_draft_drift.py`` (frozen vs online
draft). It knows nothing of what the benchmarks compute from the metrics.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CONFIG = os.path.join(ROOT, "launch", "configs", "demo.yaml")


def run(cmd: Sequence[str], tag: str) -> None:
    print(f"[{tag}] " + " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(list(cmd), check=True)


def add_run_args(ap, *, steps: int, port: int) -> None:
    """The flags both GRPO benchmarks take: where the models live, the config, steps and the rendezvous
    port."""
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "runs", "bench_grpo"))
    ap.add_argument("--base", default=None, help="policy HF checkpoint (default: trained here and cached)")
    ap.add_argument("--draft", default=None, help="ModelOpt EAGLE-3 draft (default: trained here and cached)")
    ap.add_argument("--config", default=DEMO_CONFIG)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--port", type=int, default=port)
    ap.add_argument("--sft-steps", type=int, default=300)


def ensure_models(work_dir: str, base: str | None = None, draft: str | None = None, *, sft_steps: int = 300,
                  tag: str = "bench") -> tuple[str, str]:
    """``(base, draft)`` directories: the ones given, or the demo's base (SFT with 30% noisy
    targets, docs/demo.md) and its ModelOpt EAGLE-3 draft made in ``work_dir`` when missing there."""
    os.makedirs(work_dir, exist_ok=True)
    if base is None:
        base = os.path.join(work_dir, "base")
        if not os.path.isdir(base):
            run([sys.executable, os.path.join(ROOT, "launch", "sft_base.py"), "--out", base,
                 "--steps", str(sft_steps), "--noisy-frac", "0.3"], tag)
    if draft is None:
        draft = os.path.join(work_dir, "eagle3")
        if not os.path.isdir(draft):
            run(
                [
                    sys.executable,
                    os.path.join(ROOT, "launch", "make_draft.py"),
                    "--target",
                    base,
                    "--out",
                    draft,
                ],
                tag,
            )
    return base, draft


def grpo_cmd(
    run_dir: str,
    base: str,
    steps: int,
    *,
    draft_kind: str = "eagle3",
    draft: str | None = None,
    config: str = DEMO_CONFIG,
    nproc: int = 1,
    port: int = 29611,
    extra: Sequence[str] = (),
) -> list[str]:
    """The launcher command of one GRPO run from ``base`` (no held-out evaluation, quiet)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={port}",
        os.path.join(ROOT, "launch", "pretrain_grpo_spec.py"),
        "--config",
        config,
        "--hf-checkpoint",
        base,
        "--train-iters",
        str(steps),
        "--save",
        run_dir,
        "--spec-draft-kind",
        draft_kind,
        "--eval-interval",
        "0",
        "--quiet",
    ]
    if draft_kind in ("eagle3", "model"):
        cmd += ["--spec-draft-path", draft]
    return cmd + list(extra)


def run_grpo(cmd: list[str], run_dir: str, tag: str, on_step: Callable[[dict], None] | None = None,
             threads: int | None = None, env: dict[str, str] | None = None) -> list[dict]:
    """Run ``cmd`` (from :func:`grpo_cmd`) into a fresh ``run_dir``; returns its metrics rows.
    ``on_step(row)`` is called for each step's metrics as the run writes them. ``threads``: torch
    threads of the trainer and the engine (``OMP_NUM_THREADS`` and ``--rollout-num-threads``); on a
    machine shared with other jobs, 1 avoids OpenMP's spinning threads fighting over the cores
    (measured here: a ModelOpt draft step 20 s with 2 threads under load, 0.8 s with 1). ``env``: the run's
    environment instead of this process's."""
    if threads is not None:
        env = dict(env or os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        cmd = list(cmd) + ["--rollout-num-threads", str(threads)]
    from megatron_spec.telemetry import read_metrics

    if os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
    path = os.path.join(run_dir, "metrics.jsonl")
    print(f"[{tag}] " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=env)
    seen = 0
    while True:
        done = proc.poll() is not None
        if on_step is not None and os.path.exists(path):
            rows = read_metrics(path)
            for row in rows[seen:]:
                on_step(row)
            seen = len(rows)
        if done:
            break
        time.sleep(1.0)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return read_metrics(path)


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")
