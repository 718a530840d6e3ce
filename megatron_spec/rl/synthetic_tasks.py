"""Synthetic verifiable tasks with step-by-step answers (the CPU demo's workload).

``sum``: add a list of one-digit numbers, one running total per step::

    prompt:   "3+5+2+7="
    response: "3+5=8;8+2=10;10+7=17#17"

Most of a response is copied from the prompt or from the previous step (predictable: the
draft accepts it), the arithmetic in between is what the policy must learn. The reward is 1
when the number after the last ``#`` equals the true sum.

Nothing here knows about tokenizers or models.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    solution: str
    """A correct step-by-step response (SFT target)."""


def sum_example(rng: random.Random, min_terms: int = 3, max_terms: int = 6) -> Example:
    terms = [rng.randint(1, 9) for _ in range(rng.randint(min_terms, max_terms))]
    steps, total = [], terms[0]
    for t in terms[1:]:
        steps.append(f"{total}+{t}={total + t}")
        total += t
    return Example(
        prompt="+".join(map(str, terms)) + "=", answer=str(total), solution=";".join(steps) + f"#{total}"
    )


def sum_long_example(rng: random.Random) -> Example:
    """``sum`` with 2..12 terms: responses of 1..11 steps, lengths that vary as an RL batch's do
    (the GRPO-shaped rollout benchmark's task)."""
    return sum_example(rng, 2, 12)


TASKS = {"sum": sum_example, "sum_long": sum_long_example}


def corrupt_solution(example: Example, rng: random.Random | None = None) -> str:
    """A systematically wrong solution of a ``sum`` example: the last step's result one too high
    (and so the final answer), as a recurring annotation error in SFT data would be. A model
    SFT'd on a share of these learns the task and, at that one decision, the error with the
    same share: a flaw the outcome reward sees and GRPO can remove. ``rng`` is unused (kept so
    other corruptions can draw)."""
    terms = [int(t) for t in example.prompt.rstrip("=").split("+")]
    steps, total = [], terms[0]
    for i, t in enumerate(terms[1:], start=1):
        new = total + t + (1 if i == len(terms) - 1 else 0)
        steps.append(f"{total}+{t}={new}")
        total = new
    return ";".join(steps) + f"#{total}"


def generate(task: str, n: int, seed: int) -> list[Example]:
    """``n`` examples of ``task`` from a fixed seed."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; expected one of {sorted(TASKS)}")
    rng = random.Random(seed)
    return [TASKS[task](rng) for _ in range(n)]


def iterate(task: str, seed: int) -> Iterator[Example]:
    rng = random.Random(seed)
    while True:
        yield TASKS[task](rng)


_FINAL = re.compile(r"#\s*(-?\d+)\s*$")


def final_answer(response: str) -> str | None:
    """The number after the last ``#`` (the response must end there), else None."""
    m = _FINAL.search(response.strip())
    return m.group(1) if m else None
