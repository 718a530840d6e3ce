"""Stage timers, metrics writers (JSONL + TensorBoard) and the live progress line.

* :class:`StageTimer` times the stages of a step (``with timer("gen"): ...``) and reports
  ``time/<stage>`` plus ``time/step``.
* :class:`MetricsWriter` appends one JSON object per step to the metrics file (flushed and
  fsynced, so a crash loses at most the step in flight) and mirrors scalars to TensorBoard.
* :func:`progress_line` formats reward, acceptance length and stage times for the console;
  :func:`generation_bar` is the bar a long generation shows meanwhile.

Metric names are a contract (docs/metrics.md); this module does not invent any.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

STAGES = ("data", "prepare", "gen", "reward", "logprob", "train")


class StageTimer:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._t0 = time.perf_counter()

    def reset(self) -> None:
        self.times = {}
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times[stage] = self.times.get(stage, 0.0) + time.perf_counter() - t

    def metrics(self) -> dict[str, float]:
        out = {f"time/{s}": self.times.get(s, 0.0) for s in STAGES}
        out.update({f"time/{s}": v for s, v in self.times.items() if s not in STAGES})
        # a step's time is its training work: held-out evaluation (time/eval) is not part of it
        out["time/step"] = time.perf_counter() - self._t0 - self.times.get("eval", 0.0)
        return out


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Metrics JSONL (append, fsync per line), and optional TensorBoard scalars and W&B run."""

    def __init__(self, path: str, tensorboard_dir: str | None = None, resume_step: int | None = None,
                 wandb_init: Mapping[str, Any] | None = None):
        """``resume_step``: a run resumed from the checkpoint of that step continues the files, dropping what
        the run before it wrote after that step (rows it will write again; TensorBoard's ``purge_step``).
        ``wandb_init``: ``wandb.init``'s arguments (W&B is imported only then)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        if resume_step is not None and os.path.isfile(path):
            with open(path) as f:
                kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, path)
        self._f = open(path, "a", buffering=1)
        self._tb = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                tensorboard_dir, purge_step=None if resume_step is None else resume_step + 1
            )
        self._wandb = None
        if wandb_init is not None:
            import wandb

            self._wandb = wandb.init(**wandb_init)

    def write(self, metrics: Mapping[str, Any]) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in metrics.items()}) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        step = int(metrics["step"])
        scalars = {k: v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and k != "step" and math.isfinite(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            # A step's row is whole when written: commit it now. With ``step=`` W&B otherwise holds the row
            # open until a later step or ``finish`` (``commit=False`` by default), and a crash loses the last
            # step.
            self._wandb.log(scalars, step=step, commit=True)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def open_metrics(cfg, run_dir: str, resume_step: int | None) -> MetricsWriter:
    """The run's :class:`MetricsWriter` from ``--logger`` and the logging settings (rank 0). The W&B run's id
    is the run folder's, so the same command started again continues the same W&B run."""
    import hashlib

    lg = cfg.logging
    sinks = set(lg.logger.split(","))
    tb = None
    if "tensorboard" in sinks and lg.tensorboard_dir != "none":
        tb = lg.tensorboard_dir or os.path.join(run_dir, "tensorboard")
    wandb_init = None
    if "wandb" in sinks:
        run_id = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:16]
        wandb_init = {
            "project": lg.wandb_project,
            "name": lg.wandb_name or os.path.basename(os.path.abspath(run_dir)),
            "id": run_id,
            "resume": "allow",
            "dir": run_dir,
            "config": cfg.to_dict(),
        }
    return MetricsWriter(
        lg.metrics_path or os.path.join(run_dir, "metrics.jsonl"),
        tb,
        resume_step=resume_step,
        wandb_init=wandb_init,
    )


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All step records of a metrics file (a truncated last line from a crash is skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def start_end_means(rows: list[Mapping[str, Any]], key: str) -> tuple[float, float, int]:
    """Mean of ``key`` over the first and the last fifth of ``rows`` (at least one row each) and
    that window's length: one step's mean reward depends on which prompts it drew, so a run's
    start and end are read over windows. Missing values are skipped (nan if a window has none)."""
    w = max(1, len(rows) // 5)

    def avg(part):
        xs = [float(r[key]) for r in part if r.get(key) is not None]
        return sum(xs) / len(xs) if xs else float("nan")

    return avg(rows[:w]), avg(rows[-w:]), w


def format_duration(seconds: float) -> str:
    """``42s``, ``4m05s``, ``2h03m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(m: Mapping[str, Any], total_steps: int, eta_s: float | None = None) -> str:
    """The step's line; ``eta_s``: the time the run's remaining steps will take at this run's pace so far
    (saves and evaluations included), shown until the last step."""
    acc = m.get("spec/accept_length")
    parts = [
        f"step {m['step']:>4}/{total_steps}",
        f"reward {m.get('reward/mean', float('nan')):.3f}",
        f"accept {acc:.2f}" if acc else "accept  -  ",
        f"len {m.get('rollout/response_length_mean', 0):.0f}",
        "gen {:.1f}s prep {:.1f}s lp {:.1f}s train {:.1f}s step {:.1f}s".format(
            m.get("time/gen", 0), m.get("time/prepare", 0), m.get("time/logprob", 0), m.get("time/train", 0),
            m.get("time/step", 0)),
    ]
    for key, label in (("eval/reward", "held-out"), ("eval_final/reward", "held-out final")):
        if m.get(key) is not None:
            parts.append(f"{label} {m[key]:.3f}")
    if eta_s is not None and m["step"] < total_steps:
        parts.append(f"eta {format_duration(eta_s)}")
    return " | ".join(parts)


def configure_logging(rank: int) -> None:
    """This package's ``logging`` lines on stderr, ``megatron-spec: <message>``: INFO and above from rank 0
    (resumed from, checkpoints pruned, ...), warnings and errors from every rank. Other libraries' loggers
    are left as they are (megatron-core's INFO lines would drown the step lines)."""
    import logging

    log = logging.getLogger("megatron_spec")
    if any(getattr(h, "megatron_spec", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.megatron_spec = True
    handler.setFormatter(logging.Formatter("megatron-spec: %(message)s" if rank == 0 else
                                           f"megatron-spec (rank {rank}): %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


@contextlib.contextmanager
def generation_bar(total: int, *, enabled: bool = True, delay_s: float = 5.0, file=None):
    """A tqdm bar over the samples of one generation, as ``on_progress(samples done)`` of the engines'
    ``generate``: shown on a terminal only (a log file gets the step line, not carriage returns), only once
    the generation has run ``delay_s`` (a short one prints nothing), and removed when it ends."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="generating", unit="sample", delay=delay_s, leave=False, dynamic_ncols=True,
               file=file if file is not None else sys.stderr, disable=None if enabled else True)
    done = [0]

    def update(n: int) -> None:
        bar.update(n - done[0])
        done[0] = n

    try:
        yield update
    finally:
        bar.close()


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def current_rss_mb() -> float:
    """This process's resident memory now (MB; the peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
