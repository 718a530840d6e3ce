"""The adaptive controller's decisions, one JSON line per verify step (``--spec-trace PATH``).

Each line says what the controller planned, what it expected and what the step gave, so that a
regression of adaptive speculation (a plan chosen where plain decoding would have paid more) can be
seen step by step rather than only in a benchmark's ratio::

    {"step": 41, "rows": 16, "plan": "all", "k": 0, "m": 0, "predicted_tps": 512.3, "calibration": 0.97,
     "explored": false, "held": false, "best_tps": 497.0, "tokens": 16, "seconds": 0.0312, "draft_s": 0.0,
     "realized_tps": 512.8, "prefill": false, "pid": 4242}

``predicted_tps`` is the cost model's rate for the plan (None for the steps it did not choose by rate: the
first, the widest-batch measurement, a forced tree), ``calibration`` the factor it was multiplied by when
chosen (the plan's priced over its real seconds; where rows choose between sources, its realised over its
predicted rate), ``held`` whether the step kept plain decoding without a choice
(``megatron_spec.rollout.native.exploration.Hold``: its predicted rate is the last full
choice's), ``best_tps`` the calibrated rate of the best plan (an exploring step ran another),
``tokens`` / ``seconds`` what the step kept and took (proposal, verify, host work), ``draft_s`` the main
drafter's proposal within it (0 where it did not run).
Read it with ``pandas.read_json(path, lines=True)`` or line by line with ``json.loads``.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any


class DecisionTrace:
    """Appends one record per step to ``path`` (line-buffered: a crashed run keeps what it wrote)."""

    def __init__(self, path: str | os.PathLike):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file: IO[str] = open(path, "a", buffering=1)
        self._pid = os.getpid()

    def __call__(self, controller: Any, tokens: int, seconds: float, prefill: bool, chosen: tuple | None,
                 explored: tuple | None) -> None:
        plan, rows = controller.last_plan
        predicted = chosen[2] if chosen is not None else None  # chosen: (plan, rows, its predicted rate)
        record = {
            "step": controller.steps, "rows": rows, "plan": plan.mode, "k": plan.k, "m": plan.m,
            "predicted_tps": None if predicted is None else round(predicted, 3),
            "calibration": round(controller.calibration(plan, rows), 4),
            "explored": explored is not None, "held": bool(controller.last_held),
            "best_tps": None if explored is None else round(explored[2], 3),
            "tokens": int(tokens), "seconds": round(seconds, 6), "draft_s": round(controller.last_draft_s, 6),
            "realized_tps": round(tokens / seconds, 3) if seconds > 0 else None,
            "prefill": bool(prefill), "pid": self._pid,
        }
        self._file.write(json.dumps(record) + "\n")
