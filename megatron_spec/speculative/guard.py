"""Lossless guard: refuse rollout settings under which speculative decoding changes the distribution.

``check_lossless(config, sampling=...)`` inspects a rollout configuration: our own dataclass, a dict,
or an SGLang ``ServerArgs`` (any object with attributes) and raises :class:`LossyConfigError`
(a ``ValueError``) naming every setting that breaks verifier-exactness. What it checks, from the
SGLang 0.5.23 sources (``srt/arg_groups/fields/spec.py``, ``srt/speculative/eagle_utils.py``,
``srt/speculative/spec_sampling_mask.py``, ``srt/arg_groups/speculative_hook.py``) and the equivalent
knobs of other engines:

* ``*accept_threshold_single`` / ``*accept_threshold_acc`` must be 1.0: below 1 SGLang accepts a draft
  whose target probability exceeds ``threshold_single`` outright, or with ``min(1, p / threshold_acc)``,
  more often than ``min(1, p/q)`` allows; SGLang itself treats anything but 1.0 as not exact.
* typical acceptance (vLLM ``spec_decoding_acceptance_method="typical_acceptance_sampler"``) and
  relaxed acceptance (TensorRT-LLM ``use_relaxed_acceptance_for_thinking``) are lossy by design.
* ``SGLANG_SIMULATE_ACC_LEN > 0`` fakes acceptance lengths.
* SGLang verifies EAGLE-family drafts by argmax on ``device`` cpu / xpu (and on ROCm unless
  ``speculative_use_rejection_sampling``), ignoring temperature: lossy for any non-greedy row.
* SGLang's EAGLE verify renormalises with top-k and top-p but never applies ``min_p``: lossy for
  rows with ``min_p > 0``.
* Only speculative algorithms whose verification we checked are allowed (EAGLE, EAGLE3, NEXTN,
  STANDALONE, NGRAM: they go through ``eagle_sample``). DFLASH falls back to argmax verification on
  builds without its sampling kernel; the others (DSPARK, UNO, FROZEN_KV_MTP, ...) are unreviewed.

The SGLang-specific rules apply when the config targets SGLang (``speculative_algorithm`` set, or
``backend``/``rollout_backend == "sglang"``) with speculation on (an algorithm, or ``spec_draft_kind``
other than ``"none"``). Field names of our own config that the guard reads (nested configs up to two
levels, e.g. ``RunConfig.rollout`` / ``RunConfig.spec``): the threshold names above with or without the
``speculative_`` prefix, ``acceptance_method``, ``speculative_algorithm``, ``spec_draft_kind``,
``backend``/``rollout_backend``, ``device``, and ``temperature``/``rollout_temperature`` and
``min_p``/``rollout_min_p`` when no ``sampling`` is passed.
It does not decide which draft or sampling settings are *useful*; only which ones are lossy.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LossyConfigError", "check_lossless", "SGLANG_EXACT_ALGORITHMS"]

SGLANG_EXACT_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"})
_LOSSY_METHOD_WORDS = ("typical", "relaxed", "lossy")
_MISSING = object()


class LossyConfigError(ValueError):
    """A rollout setting would make speculative outputs deviate from the target distribution."""


def _is_config(value: Any) -> bool:
    return isinstance(value, Mapping) or (
        not isinstance(value, type)
        and (dataclasses.is_dataclass(value) or hasattr(type(value), "__struct_fields__"))
    )


def _fields(obj: Any) -> dict[str, Any]:
    """Field name -> value of a dict, dataclass, msgspec Struct (SGLang's ServerArgs) or namespace."""
    if isinstance(obj, Mapping):
        return dict(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    struct_fields = getattr(type(obj), "__struct_fields__", None)
    if struct_fields is not None:
        return {name: getattr(obj, name) for name in struct_fields}
    if hasattr(obj, "__dict__"):
        return {k: v for k, v in vars(obj).items() if not k.startswith("__")}
    raise TypeError(
        f"check_lossless: cannot read the fields of {type(obj).__name__}; pass a dataclass, dict, "
        f"msgspec Struct or object with attributes"
    )


def _flatten(obj: Any, prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """Field name -> value, descending into nested configs (dataclass / dict / namespace) twice."""
    out: dict[str, Any] = {}
    for name, value in _fields(obj).items():
        path = f"{prefix}{name}"
        if _is_config(value) and depth < 2:
            out.update(_flatten(value, f"{path}.", depth + 1))
        else:
            out[path] = value
    return out


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _find(flat: dict[str, Any], *names: str) -> tuple[str, Any]:
    for path, value in flat.items():
        if _leaf(path) in names:
            return path, value
    return "", _MISSING


def _sampling_stats(sampling: Any) -> tuple[bool | None, float | None]:
    """(all rows greedy?, max min_p) of a SamplingTensors / mapping / object; None when unknown."""
    if sampling is None:
        return None, None
    fields = _fields(sampling) if not isinstance(sampling, Mapping) else dict(sampling)
    temp = fields.get("temperature")
    min_p = fields.get("min_p")

    def to_tensor(v):
        return v if isinstance(v, torch.Tensor) else torch.as_tensor(v, dtype=torch.float64)

    all_greedy = None if temp is None else bool((to_tensor(temp) == 0).all())
    if min_p is None:
        return all_greedy, None
    mp = to_tensor(min_p).double().reshape(-1)
    if temp is not None:  # min_p does not matter on greedy rows
        t, mp = torch.broadcast_tensors(to_tensor(temp).double().reshape(-1), mp)
        mp = mp[t != 0]
    return all_greedy, float(mp.max()) if mp.numel() else 0.0


def check_lossless(
    config: Any,
    *,
    sampling: Any = None,
    environ: Mapping[str, str] | None = None,
    is_rocm: bool | None = None,
) -> None:
    """Raise :class:`LossyConfigError` if ``config`` makes speculative decoding lossy.

    Args:
        config: our rollout config (dataclass), a dict, or an SGLang ``ServerArgs``-like object.
        sampling: the sampling parameters that will be used (``SamplingTensors``, a dict or an object
            with ``temperature`` / ``min_p``); None when unknown, which is treated as "may sample".
        environ: environment of the engine process (default ``os.environ``).
        is_rocm: whether the engine runs on ROCm (default: this torch build's ``torch.version.hip``).
    """
    flat = _flatten(config)
    env = os.environ if environ is None else environ
    rocm = bool(torch.version.hip) if is_rocm is None else is_rocm
    if sampling is None:  # our RunConfig carries the sampling parameters itself
        found = {key: _find(flat, key, f"rollout_{key}")[1] for key in ("temperature", "min_p")}
        sampling = {key: v for key, v in found.items() if v is not _MISSING and v is not None} or None
    all_greedy, max_min_p = _sampling_stats(sampling)
    problems = _acceptance_rule_problems(flat)
    _, algo = _find(flat, "speculative_algorithm")
    _, draft_kind = _find(flat, "spec_draft_kind", "draft_kind")
    _, backend = _find(flat, "backend", "rollout_backend")
    has_algo = algo is not _MISSING and algo is not None
    speculative = has_algo or (draft_kind not in (_MISSING, None) and str(draft_kind).lower() != "none")
    sglang = has_algo or backend == "sglang"
    if sglang and speculative:
        problems += _sglang_problems(flat, algo, env, rocm, all_greedy, max_min_p)
    if problems:
        raise LossyConfigError("lossy speculative-decoding settings:\n  - " + "\n  - ".join(problems))


def _acceptance_rule_problems(flat: dict[str, Any]) -> list[str]:
    """Any engine's settings that replace the rejection rule ``min(1, p/q)``: acceptance thresholds below
    (or above) 1, typical or relaxed acceptance."""
    problems: list[str] = []
    for path, value in flat.items():
        leaf = _leaf(path)
        if leaf.endswith("accept_threshold_single") or leaf.endswith("accept_threshold_acc"):
            if value is not None and float(value) != 1.0:
                problems.append(
                    f"{path} = {value}: must be 1.0; any other value moves SGLang's acceptance rule away "
                    f"from min(1, p/q) (below 1 it accepts drafts the target would not have sampled)"
                )
        elif leaf.endswith("acceptance_method") and isinstance(value, str):
            if any(word in value.lower() for word in _LOSSY_METHOD_WORDS):
                problems.append(
                    f"{path} = {value!r}: typical/relaxed acceptance is lossy; use rejection sampling"
                )
        elif leaf == "use_relaxed_acceptance_for_thinking" and value:
            problems.append(f"{path} = {value}: relaxed acceptance is lossy")
    return problems


def _sglang_problems(flat: dict[str, Any], algo: Any, env: Mapping[str, str], rocm: bool,
                     all_greedy: bool | None, max_min_p: float | None) -> list[str]:
    """What makes SGLang's speculative decoding lossy beyond the acceptance rule: an algorithm whose
    verification is unreviewed, simulated acceptance, argmax verification where rows sample, ``min_p``."""
    problems: list[str] = []
    algo_name = None if algo is _MISSING or algo is None else str(algo).upper()
    if algo_name is not None and algo_name not in SGLANG_EXACT_ALGORITHMS:
        problems.append(
            f"speculative_algorithm = {algo!r}: verification not reviewed as exact by megatron-spec "
            f"(allowed: {', '.join(sorted(SGLANG_EXACT_ALGORITHMS))})"
        )
    sim = env.get("SGLANG_SIMULATE_ACC_LEN")
    if sim is not None:
        try:
            simulated = float(sim) > 0
        except ValueError:
            simulated = True
        if simulated:
            problems.append(
                f"SGLANG_SIMULATE_ACC_LEN = {sim!r}: simulated acceptance does not sample the target"
            )
    _, device = _find(flat, "device")
    _, rejection = _find(flat, "speculative_use_rejection_sampling")
    greedy_verify_device = isinstance(device, str) and device.split(":")[0].lower() in ("cpu", "xpu")
    greedy_verify_rocm = rocm and not (rejection is not _MISSING and bool(rejection))
    if (greedy_verify_device or greedy_verify_rocm) and all_greedy is not True:
        where = (
            f"device {device!r}"
            if greedy_verify_device
            else "ROCm without speculative_use_rejection_sampling"
        )
        problems.append(
            f"SGLang verifies drafts by argmax on {where}, ignoring temperature: only temperature-0 "
            "sampling is exact there (sampling "
            f"{'unknown' if all_greedy is None else 'is not all greedy'})"
        )
    if max_min_p is not None and max_min_p > 0:
        problems.append(
            f"min_p = {max_min_p}: SGLang's speculative verify does not apply min_p (only top-k/top-p), "
            f"so rows with min_p > 0 are not sampled from the processed target"
        )
    return problems
