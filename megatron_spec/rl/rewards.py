"""Reward functions: plain Python callables chosen by name or ``module:function``.

Signature: ``reward(prompt: str, response: str, answer: str) -> float``. A reward that raises
stops the run with an error naming the function and the sample (a silently zeroed reward
would bias training without anyone noticing).

* ``synthetic``: the synthetic tasks' checker (``megatron_spec.rl.tasks.final_answer``).
* ``math``: a math answer verifier built on the ``math-verify`` package (LaTeX / expressions
  compared symbolically); takes GSM8K answers (``... #### 72``) and ``\\boxed{}`` answers as
  they are in the data.
* ``exact``: stripped string equality.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from megatron_spec.rl.tasks import final_answer

RewardFn = Callable[[str, str, str], float]


class RewardError(RuntimeError):
    """A reward function failed on a sample."""


def synthetic_reward(prompt: str, response: str, answer: str) -> float:
    return 1.0 if final_answer(response) == answer.strip() else 0.0


def _final_part(text: str) -> str:
    """GSM8K's convention: the final answer follows the last ``####`` (the worked solution
    before it holds other numbers, ``<<48/2=24>>``, that must not be taken for the answer)."""
    return text.rsplit("####", 1)[1].strip() if "####" in text else text


def math_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when math-verify finds the response's final answer equal to the reference.

    Both sides go to ``math_verify.parse`` as they are (a ``\\boxed{}`` answer, LaTeX, a plain
    number, an expression), except that text after a last ``####`` is the answer (GSM8K's
    ``answer`` column and responses in its format); a response without ``$`` or ``\\boxed`` is also
    read between ``$...$`` (a bare list, ``-80, -6, -1``, is one answer only there; math-verify
    compares lists as sets, so the order of a list is not checked). A reference that is one word
    (mathematics_dataset's ``True`` / ``False``) is matched by the response's last word,
    case-insensitively.
    math-verify's timeouts use ``signal.alarm``,
    which works on the main thread only: elsewhere they are off.
    """
    import threading

    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_text = _final_part(answer)
    if gold_text.strip().rstrip(".").isalpha():  # a word, no math (mathematics_dataset's True/False)
        words = _final_part(response).strip().rstrip(".").split()
        return 1.0 if words and words[-1].lower() == gold_text.strip().rstrip(".").lower() else 0.0
    if "$" not in gold_text and "\\boxed" not in gold_text:
        gold_text = f"${gold_text}$"
    gold = parse(gold_text, parsing_timeout=timeout)
    if not gold:
        return 0.0
    text = _final_part(response)
    preds = [parse(text, parsing_timeout=timeout)]
    if "$" not in text and "\\boxed" not in text:
        # a bare list or expression ("-80, -6, -1": mathematics_dataset's comparison__sort) is read
        # as one answer only between $...$, as the reference is; plain text keeps the first reading
        preds.append(parse(f"${text.strip()}$", parsing_timeout=timeout))
    return 1.0 if any(p and verify(gold, p, timeout_seconds=timeout) for p in preds) else 0.0


def exact_reward(prompt: str, response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


REGISTRY: dict[str, RewardFn] = {"synthetic": synthetic_reward, "math": math_reward, "exact": exact_reward}


def get_reward(spec: str) -> RewardFn:
    """A registered name, or ``package.module:function``."""
    if spec in REGISTRY:
        return REGISTRY[spec]
    if ":" not in spec:
        raise ValueError(f"reward {spec!r} is neither a registered name {sorted(REGISTRY)} nor 'module:function'")
    module_name, fn_name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward {spec!r} cannot be imported: {exc}") from exc
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable")
    return fn


def score(fn: RewardFn, name: str, prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """Apply ``fn`` to every sample; any exception or non-finite value is a :class:`RewardError`."""
    out = []
    for i, (p, r, a) in enumerate(zip(prompts, responses, answers)):
        try:
            value = float(fn(p, r, a))
        except Exception as exc:
            raise RewardError(f"reward function {name!r} raised on sample {i} (prompt {p[:60]!r}): "
                              f"{type(exc).__name__}: {exc}") from exc
        if value != value or value in (float("inf"), float("-inf")):
            raise RewardError(f"reward function {name!r} returned {value} on sample {i}")
        out.append(value)
    return out
