"""Engine calls run step by step in turn, each timed by its own steps only.

Run one after the other, two calls of a few seconds each meet different minutes of this shared VM, whose
speed drifts by 10-25% within a minute: a round's ratio then carries the drift (rounds of the same work
scattered by +-15%). Here the calls advance together, one scheduler step each in turn
(``EngineCore.generate_steps``), and each call's clock counts only the time spent inside its own steps, so
both meet the same moments of the machine, tens of milliseconds apart. The steps are the engines' own:
what a call samples and its statistics are those of its ``generate`` (tests/rollout/test_engine_helpers.py);
only ``wall_s`` (and so ``tokens_per_s``) becomes the call's own time, without the others' steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator


def run_in_turn(calls: dict[str, Callable[[Callable], Generator]]) -> dict[str, tuple]:
    """``calls``: name -> a function that takes an ``on_sample_done`` callback and starts the call
    (``lambda done: core.generate_steps(requests, done, seed=s)``). Steps every unfinished call once per
    pass, in the order given, until all are done. Per name: ``(samples, stats, finish)``, ``stats.wall_s``
    the call's own time (the sum of its steps), ``finish`` each sample's finish on that clock."""
    clock = dict.fromkeys(calls, 0.0)
    finish: dict[str, list[float]] = {name: [] for name in calls}
    started = [0.0]  # the step now running began here (perf_counter)

    def on_done(name: str) -> Callable:
        def done(sample) -> None:
            finish[name].append(clock[name] + time.perf_counter() - started[0])
        return done

    running = {name: start(on_done(name)) for name, start in calls.items()}
    out: dict[str, tuple] = {}
    while running:
        for name in list(running):
            started[0] = time.perf_counter()
            try:
                next(running[name])
            except StopIteration as end:
                samples, stats = end.value
                del running[name]
                out[name] = (samples, stats, finish[name])
            clock[name] += time.perf_counter() - started[0]
    for name, (_, stats, _) in out.items():
        stats.wall_s = clock[name]
    return {name: out[name] for name in calls}
