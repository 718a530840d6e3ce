"""Measured forward times, where a GPU run measured them: the simulator's calibration points.

``benchmarks/measure_forward_costs.py`` (step 5 of the GPU check kit, scripts/gpu_check.sh) times the
native engine's verify forward of B rows x (k+1) tokens and its EAGLE-3 draft passes for real model shapes
on a real GPU, at a fixed context per row. A run's JSON, committed as ``data/measured_forwards.json``, is
read here: :func:`measured_for` returns the table of one (hardware, model, dtype) at tp = ep = 1, and
``roofline.ForwardModel`` uses it where it covers a forward's batch size and query count:

    t(b, q, ctx) = t_measured(b, q) + roofline(b, q, ctx) - roofline(b, q, b * ctx_measured)

so the measurement holds at its own context and the roofline only carries the context's effect (KV
reads) elsewhere. Batch sizes between measured ones are interpolated in log B; outside the measured
range, at another query count, or for another model, GPU, dtype or parallelism, the roofline alone
answers. It knows nothing about RL steps or engines.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from megatron_spec.sim.hardware import DATA_DIR

MEASURED_PATH = DATA_DIR / "measured_forwards.json"
_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32", "fp32": "fp32"}


@dataclasses.dataclass(frozen=True)
class MeasuredForwards:
    """Seconds of one kind of forward (``role``) per query count and batch size, at ``ctx_per_seq``."""

    table: dict[int, dict[int, float]]
    """``{q: {B: seconds}}``: q tokens per row (k + 1 for a verify, 1 for a draft pass)."""
    ctx_per_seq: int
    source: str
    role: str

    def lookup(self, b, q: int) -> tuple[np.ndarray, np.ndarray]:
        """Measured seconds at batch sizes ``b`` (array) and query count ``q``, and where they hold."""
        b = np.asarray(b, dtype=float)
        row = self.table.get(int(q))
        if not row:
            return np.zeros_like(b), np.zeros(b.shape, dtype=bool)
        bs = np.array(sorted(row), dtype=float)
        ts = np.array([row[int(x)] for x in bs])
        hit = (b >= bs[0]) & (b <= bs[-1])
        t = np.interp(np.log(np.clip(b, bs[0], bs[-1])), np.log(bs), ts)
        return np.where(hit, t, 0.0), hit

    def describe(self) -> dict:
        qs = sorted(self.table)
        bs = sorted({b for row in self.table.values() for b in row})
        return {"role": self.role, "source": self.source, "ctx_per_seq": self.ctx_per_seq, "q": qs,
                "batch": [bs[0], bs[-1]] if bs else []}


def load_doc(path: str | Path | None = None) -> dict | None:
    """The measured-forwards JSON at ``path`` (default: the committed one), or None where there is none."""
    path = Path(path) if path else MEASURED_PATH
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


def measured_for(model, hw, dtype: str, par, role: str, path: str | Path | bool | None = None
                 ) -> MeasuredForwards | None:
    """The measured table for ``model`` (a ``ModelProfile``; for ``role`` ``eagle3`` the target's) on ``hw``.

    Args:
        role: ``target`` (verify forwards) or ``eagle3`` (the draft's passes).
        path: a measured-forwards JSON; None: the committed one if it exists; False: none.
    """
    if path is False or par.tp != 1 or par.ep != 1:
        return None
    doc = load_doc(None if path is True else path)
    if doc is None or doc.get("hardware") != hw.name:
        return None
    for entry in doc.get("entries", []):
        if entry.get("model") != model.name or entry.get("quick"):
            continue
        if _DTYPES.get(entry.get("dtype")) != _DTYPES.get(dtype, dtype):
            continue
        if role == "target":
            table = {
                int(k) + 1: {int(b): float(s) for b, s in row.items()} for k, row in entry["verify_s"].items()
            }
        else:
            table = {int(k) + 1: {int(b): float(s) for b, s in row.items()}
                     for k, row in entry.get("eagle3_extend_s", {}).items()}
            table[1] = {int(b): float(s) for b, s in entry["eagle3_draft_pass_s"].items()}
        source = (f"{doc.get('device', hw.name)}, {doc.get('measured_at', '?')}, commit "
                  f"{str(doc.get('commit'))[:9]}")
        return MeasuredForwards(table, int(entry["ctx_per_seq"]), source, role)
    return None
