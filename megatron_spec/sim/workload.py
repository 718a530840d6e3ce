"""RL workloads: how many rollouts a step generates and how long they are.

Response lengths follow a log-normal law (median, sigma) clipped at ``max_response_len`` (the
clipped mass is the truncated responses). A synchronous step waits for its slowest sequence, so
the simulated engine is the one that holds it: its R lengths are the quantiles
(i + 0.5) / R of the law, except the largest, which is the quantile of the longest of *all*
rollouts of the step, 1 - 0.5 / (rollouts per step). Quantiles instead of random draws keep
the simulator deterministic.

The two presets are the reference paper's workloads (docs/design.md, "Reference measurements") as far as it
describes them (Qwen3-8B, DAPO-style math, 32 GB200). Their sizes and length laws are *our
assumptions*, chosen once to be typical of DAPO-style GRPO runs, not facts from the paper; the
calibration fits efficiencies with them fixed (docs/simulator.md, "Calibration").

What it does not know: prompt-length spread, per-prompt correlation of lengths, dynamic
sampling / filtering, length growth over training.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm


@dataclass(frozen=True)
class Workload:
    """One RL step's generation and training work."""

    name: str = "custom"
    prompts_per_step: int = 128
    samples_per_prompt: int = 16
    prompt_len: int = 256
    response_median: float = 2048.0
    response_sigma: float = 0.8
    max_response_len: int = 16384

    def __post_init__(self) -> None:
        if self.prompts_per_step < 1 or self.samples_per_prompt < 1:
            raise ValueError(f"workload {self.name!r}: prompts_per_step={self.prompts_per_step} and "
                             f"samples_per_prompt={self.samples_per_prompt} must be >= 1")
        if self.prompt_len < 0:
            raise ValueError(f"workload {self.name!r}: prompt_len={self.prompt_len} must be >= 0")
        if not 1 <= self.response_median:
            raise ValueError(f"workload {self.name!r}: response_median={self.response_median} must be >= 1")
        if self.response_sigma < 0:
            raise ValueError(f"workload {self.name!r}: response_sigma={self.response_sigma} must be >= 0")
        if self.max_response_len < 1:
            raise ValueError(f"workload {self.name!r}: max_response_len={self.max_response_len} must be >= 1")

    @property
    def rollouts(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def replace(self, **changes) -> Workload:
        return dataclasses.replace(self, **changes)

    # ---- length law --------------------------------------------------------------------------
    def quantile(self, u) -> np.ndarray:
        u = np.asarray(u, dtype=float)
        raw = self.response_median * np.exp(self.response_sigma * norm.ppf(u))
        return np.clip(raw, 1.0, float(self.max_response_len))

    def mean_response_len(self) -> float:
        """E[min(X, c)] for X log-normal(mu, sigma), c = max_response_len."""
        mu, s, c = math.log(self.response_median), self.response_sigma, float(self.max_response_len)
        if s == 0:
            return min(self.response_median, c)
        z = (math.log(c) - mu) / s
        return float(math.exp(mu + s * s / 2) * norm.cdf(z - s) + c * norm.sf(z))

    def mean_sq_response_len(self) -> float:
        """E[min(X, c)^2]."""
        mu, s, c = math.log(self.response_median), self.response_sigma, float(self.max_response_len)
        if s == 0:
            return min(self.response_median, c) ** 2
        z = (math.log(c) - mu) / s
        return float(math.exp(2 * mu + 2 * s * s) * norm.cdf(z - 2 * s) + c * c * norm.sf(z))

    def truncated_fraction(self) -> float:
        if self.response_sigma == 0:
            return float(self.response_median >= self.max_response_len)
        return float(
            norm.sf((math.log(self.max_response_len) - math.log(self.response_median)) / self.response_sigma)
        )

    def engine_lengths(self, per_engine: int, seed: int = 0) -> np.ndarray:
        """Response lengths of the engine holding the step's longest rollout (see module doc),
        in a fixed shuffled admission order."""
        if per_engine < 1:
            raise ValueError(f"per_engine={per_engine} must be >= 1")
        u = (np.arange(per_engine) + 0.5) / per_engine
        u[-1] = max(u[-1], 1.0 - 0.5 / max(self.rollouts, per_engine))
        lengths = self.quantile(u)
        rng = np.random.default_rng(seed)
        return lengths[rng.permutation(per_engine)]

    def train_tokens(self) -> float:
        return self.rollouts * (self.prompt_len + self.mean_response_len())

    def attention_token_pairs(self) -> float:
        """sum over rollouts of (sequence length)^2 / 2: the causal attention work of training."""
        p = self.prompt_len
        e1, e2 = self.mean_response_len(), self.mean_sq_response_len()
        return self.rollouts * (p * p + 2 * p * e1 + e2) / 2.0

    def describe(self) -> dict:
        return {"name": self.name, "rollouts": self.rollouts, "prompts_per_step": self.prompts_per_step,
                "samples_per_prompt": self.samples_per_prompt, "prompt_len": self.prompt_len,
                "response_median": self.response_median, "response_sigma": self.response_sigma,
                "max_response_len": self.max_response_len,
                "mean_response_len": round(self.mean_response_len(), 1),
                "truncated_fraction": round(self.truncated_fraction(), 4)}


# The paper's two workloads (see module docstring: sizes and length laws are assumptions).
PRESETS: dict[str, Workload] = {
    "rl-zero": Workload(name="rl-zero", prompts_per_step=256, samples_per_prompt=16, prompt_len=200,
                        response_median=1000.0, response_sigma=1.0, max_response_len=16384),
    "rl-think": Workload(name="rl-think", prompts_per_step=256, samples_per_prompt=16, prompt_len=200,
                         response_median=3000.0, response_sigma=0.8, max_response_len=16384),
}
