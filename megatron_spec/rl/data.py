"""Prompt sets and a resumable sampler.

``load_prompts(spec)`` reads a local JSONL or Parquet file with the ``datasets`` library
(``prompt`` / ``answer`` columns by default), or generates a synthetic task
(``synthetic:sum``). :class:`PromptSampler` walks seeded per-epoch permutations; its state
(epoch, position) goes into checkpoints so a resumed run sees exactly the prompts it would
have seen.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptExample:
    prompt: str
    answer: str


def load_prompts(spec: str, *, prompt_key: str = "prompt", answer_key: str = "answer",
                 num_synthetic: int = 2048, seed: int = 0, cache_dir: str | None = None) -> list[PromptExample]:
    """All examples of a prompt set; errors name the file, column or task that is wrong."""
    if spec.startswith("synthetic:"):
        from megatron_spec.rl.tasks import generate

        return [PromptExample(e.prompt, e.answer) for e in generate(spec.split(":", 1)[1], num_synthetic, seed)]
    if not os.path.isfile(spec):
        raise FileNotFoundError(f"prompt data {spec} does not exist (use a JSONL/Parquet file or synthetic:<task>)")
    ext = os.path.splitext(spec)[1].lower()
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(ext)
    if builder is None:
        raise ValueError(f"prompt data {spec}: unsupported extension {ext!r} (.jsonl, .json or .parquet)")
    if os.path.getsize(spec) == 0:
        raise ValueError(f"prompt data {spec} is empty")
    from datasets import load_dataset

    # keep the datasets cache out of the home directory
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        try:
            ds = load_dataset(builder, data_files=spec, split="train", cache_dir=tmp, keep_in_memory=True)
        except Exception as exc:  # datasets raises bare StopIteration / ArrowInvalid on bad files
            raise ValueError(f"prompt data {spec} cannot be read as {builder}: {type(exc).__name__}: {exc}") from exc
        if len(ds) == 0:
            raise ValueError(f"prompt data {spec} is empty")
        for key in (prompt_key, answer_key):
            if key not in ds.column_names:
                raise ValueError(f"prompt data {spec} has no column {key!r} (columns: {ds.column_names})")
        rows = [PromptExample(str(r[prompt_key]), str(r[answer_key])) for r in ds]
    return rows


class PromptSampler:
    """Seeded permutation per epoch; ``next(k)`` returns indices, crossing epochs as needed."""

    def __init__(self, num_examples: int, seed: int):
        if num_examples <= 0:
            raise ValueError("the prompt set is empty")
        self.n, self.seed = num_examples, seed
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            take = min(k - len(out), self.n - self.pos)
            out += self._perm[self.pos:self.pos + take]
            self.pos += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n"] != self.n or state["seed"] != self.seed:
            raise ValueError(f"checkpoint's data sampler was for {state['n']} prompts with seed {state['seed']}, "
                             f"this run has {self.n} prompts with seed {self.seed}")
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._perm = self._permutation(self.epoch)
