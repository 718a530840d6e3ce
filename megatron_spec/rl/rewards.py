"""Reward functions: plain Python callables chosen by name, ``module:function`` or
``path/to/file.py:function``.

Signature: ``reward(prompt, response: str, answer: str) -> float``; with a parameter named ``metadata``
(or ``**kwargs``) it also gets the sample's other dataset columns as a dict (verl's ``data_source``,
``extra_info``, ...: :attr:`megatron_spec.rl.data.PromptExample.metadata`). A function marked
:func:`batched` takes the lists of a whole round, ``reward(prompts, responses, answers[, metadata])``, and
returns one float per sample (a model-based reward scores a batch at once). A reward that raises stops the
run with an error naming the function and the sample (a silently zeroed reward would bias training without
anyone noticing). ``module:function`` imports from the working directory too (torchrun puts the launcher's
folder on ``sys.path``, not it).

* ``synthetic``: the synthetic tasks' checker (``megatron_spec.rl.synthetic_tasks.final_answer``).
* ``math``: a math answer verifier built on the ``math-verify`` package (LaTeX / expressions
  compared symbolically); takes GSM8K answers (``... #### 72``) and ``\\boxed{}`` answers as
  they are in the data.
* ``exact``: stripped string equality.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from megatron_spec.rl.synthetic_tasks import final_answer

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


def batched(fn: Callable) -> Callable:
    """Mark a reward function as batched: ``fn(prompts, responses, answers[, metadata]) -> list[float]``
    (setting ``fn.batched = True`` does the same without importing this package)."""
    fn.batched = True
    return fn


@dataclasses.dataclass(frozen=True)
class Reward:
    """A reward function and how it is called (module docstring)."""

    fn: Callable
    name: str
    batched: bool = False
    wants_metadata: bool = False

    @classmethod
    def of(cls, fn: Callable, name: str) -> Reward:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin or C callable: the plain signature
            params = []
        wants = any(p.name == "metadata" or p.kind is p.VAR_KEYWORD for p in params)
        return cls(fn, name, bool(getattr(fn, "batched", False)), wants)

    def __call__(self, prompt, response: str, answer: str, metadata: dict | None = None) -> float:
        """One sample's reward (:func:`score` for a round)."""
        return score(self, [prompt], [response], [answer], [metadata or {}])[0]


def _import(spec: str) -> Callable:
    module_name, fn_name = spec.rsplit(":", 1)
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = os.path.abspath(module_name)
            if not os.path.isfile(path):
                raise ImportError(f"no such file: {path}")
            name = f"megatron_spec_reward_{abs(hash(path))}"
            module = sys.modules.get(name)  # once per process: the preflight and the task both ask for it
            if module is None:
                loader = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(loader)
                loader.loader.exec_module(module)
                sys.modules[name] = module
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.append(os.getcwd())
            module = importlib.import_module(module_name)
        return getattr(module, fn_name)
    except (ImportError, AttributeError, SyntaxError) as exc:
        raise ValueError(f"reward {spec!r} cannot be imported: {type(exc).__name__}: {exc}") from exc


def get_reward(spec: str) -> Reward:
    """A registered name, ``package.module:function`` or ``path/to/file.py:function``."""
    if spec in REGISTRY:
        return Reward.of(REGISTRY[spec], spec)
    if ":" not in spec:
        raise ValueError(
            f"reward {spec!r} is neither a registered name {sorted(REGISTRY)} nor 'module:function' "
            f"or 'path/to/file.py:function'"
        )
    fn = _import(spec)
    if not callable(fn):
        raise ValueError(f"reward {spec!r} is not callable")
    return Reward.of(fn, spec)


def _checked(reward: Reward, value: Any, where: str) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError) as exc:
        raise RewardError(
            f"reward function {reward.name!r} returned {value!r} on {where}, not a number"
        ) from exc
    if value != value or value in (float("inf"), float("-inf")):
        raise RewardError(f"reward function {reward.name!r} returned {value} on {where}")
    return value


def score(reward: Reward, prompts: list, responses: list[str], answers: list[str],
          metadata: list[dict] | None = None) -> list[float]:
    """Apply ``reward`` to every sample; any exception or non-finite value is a :class:`RewardError`."""
    metadata = metadata if metadata is not None else [{} for _ in prompts]
    extra = (lambda m: {"metadata": m}) if reward.wants_metadata else (lambda m: {})
    if reward.batched:
        try:
            values = list(reward.fn(prompts, responses, answers, **extra(metadata)))
        except Exception as exc:
            raise RewardError(
                f"batched reward function {reward.name!r} raised on a batch of {len(prompts)} samples "
                f"(the first prompt {str(prompts[0])[:60]!r}): {type(exc).__name__}: {exc}"
            ) from exc
        if len(values) != len(prompts):
            raise RewardError(f"batched reward function {reward.name!r} returned {len(values)} values for "
                              f"{len(prompts)} samples")
        return [_checked(reward, v, f"sample {i}") for i, v in enumerate(values)]
    out = []
    for i, (p, r, a, m) in enumerate(zip(prompts, responses, answers, metadata)):
        try:
            value = reward.fn(p, r, a, **extra(m))
        except Exception as exc:
            raise RewardError(
                f"reward function {reward.name!r} raised on sample {i} (prompt {str(p)[:60]!r}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        out.append(_checked(reward, value, f"sample {i}"))
    return out
