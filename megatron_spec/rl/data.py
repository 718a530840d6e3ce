"""Prompt sets and a resumable sampler.

``load_prompts(spec)`` reads local data with the ``datasets`` library (``prompt`` / ``answer``
columns by default, ``--prompt-key/--answer-key`` otherwise): a JSONL or Parquet file, a
directory ``datasets`` wrote (``save_to_disk``: its train split when it holds several), a
directory of JSONL/Parquet files, or a Hub dataset name (``openai/gsm8k``, ``openai/gsm8k:main``,
``openai/gsm8k:main@test``: repository, config, split) read from the local Hugging Face cache; or it
generates a synthetic task (``synthetic:sum``). Nothing is downloaded: a Hub dataset that is not in the
cache is an error saying how to fetch it. Answers may be in any form the reward reads (GSM8K's
``... #### 72``, a ``\\boxed{}`` answer): no column is rewritten here.

:class:`PromptSampler` walks seeded per-epoch permutations; its state
(epoch, position) goes into checkpoints so a resumed run sees exactly the prompts it would
have seen.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PromptExample:
    prompt: str | tuple[dict[str, str], ...]
    """Text, or chat messages (``{"role", "content"}``) rendered with the chat template (``rl.prompting``)."""
    answer: str
    metadata: dict = field(default_factory=dict, compare=False)
    """The row's other columns (all but the prompt's, and the answer's when its key is a top-level column):
    what a reward taking ``metadata`` gets (verl's ``data_source``, ``extra_info``; ``rl.rewards``)."""


def column(row: dict, key: str):
    """``row[key]``, where a dotted key walks nested columns (``reward_model.ground_truth``, verl's
    layout)."""
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def _messages(value) -> tuple[dict[str, str], ...] | None:
    """A list of chat messages as plain dicts, or None when ``value`` is not one."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in value):
        return None
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def load_prompts(
    spec: str,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    num_synthetic: int = 2048,
    seed: int = 0,
    cache_dir: str | None = None,
) -> list[PromptExample]:
    """All examples of a prompt set; errors name the file, column or task that is wrong."""
    if spec.startswith("synthetic:"):
        from megatron_spec.rl.synthetic_tasks import generate

        return [
            PromptExample(e.prompt, e.answer) for e in generate(spec.split(":", 1)[1], num_synthetic, seed)
        ]
    if os.path.isdir(spec):
        return _from_rows(spec, _load_dir(spec, cache_dir), prompt_key, answer_key)
    if is_hub_dataset(spec):
        return _from_rows(spec, _load_hub(spec, cache_dir), prompt_key, answer_key)
    if not os.path.isfile(spec):
        raise FileNotFoundError(
            f"prompt data {spec} does not exist (use a JSONL/Parquet file, a datasets "
            f"directory, a Hub dataset name org/name[:config][@split] or synthetic:<task>)"
        )
    ext = os.path.splitext(spec)[1].lower()
    builder = _BUILDERS.get(ext)
    if builder is None:
        raise ValueError(f"prompt data {spec}: unsupported extension {ext!r} (.jsonl, .json or .parquet)")
    if os.path.getsize(spec) == 0:
        raise ValueError(f"prompt data {spec} is empty")
    return _from_rows(spec, _load_files(spec, builder, [spec], cache_dir), prompt_key, answer_key)


_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_HUB_NAME = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?::(?P<config>[\w.-]+))?(?:@(?P<split>[\w.-]+))?$")


def is_hub_dataset(spec: str) -> bool:
    """``spec`` is no file or folder but reads as a Hub dataset name: ``org/name[:config][@split]``."""
    return not os.path.exists(spec) and not spec.startswith((".", "/")) and _HUB_NAME.match(spec) is not None


def hub_snapshot(spec: str) -> str:
    """The local Hugging Face cache's snapshot of the Hub dataset ``spec`` names (huggingface_hub's
    ``snapshot_download``, cache only: ``HF_HUB_CACHE``/``HF_HOME`` say where); FileNotFoundError saying
    how to fetch it when it is not there."""
    from huggingface_hub import constants, snapshot_download

    repo = _HUB_NAME.match(spec)["repo"]
    try:
        return snapshot_download(repo, repo_type="dataset", local_files_only=True)
    except Exception as exc:  # not cached (LocalEntryNotFoundError), a bad repository id: one message
        raise FileNotFoundError(
            f"prompt data {spec}: the Hub dataset {repo} is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and nothing is downloaded here; fetch it once with "
            f"`hf download {repo} --repo-type dataset` (HF_HOME or HF_HUB_CACHE name another cache) "
            f"[{type(exc).__name__}]") from None


def _load_hub(spec: str, cache_dir: str | None):
    """The split (default ``train``) of the config (the dataset's only or default one, unless named) of a
    cached Hub dataset, through ``datasets.load_dataset`` on its snapshot folder (the README's ``configs``
    or the files' split names say which files are which)."""
    import datasets

    m = _HUB_NAME.match(spec)
    path, split = hub_snapshot(spec), m["split"] or "train"
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        try:
            return datasets.load_dataset(path, m["config"], split=split, cache_dir=tmp, keep_in_memory=True)
        except Exception as exc:  # no such config or split (ValueError), files datasets cannot read
            text = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise ValueError(
                f"prompt data {spec}: the cached Hub dataset {m['repo']} cannot be read as config "
                f"{m['config'] or '(default)'}, split {split}: {text}"
            ) from None


def _load_files(spec: str, builder: str, files: list[str], cache_dir: str | None):
    from datasets import load_dataset

    # keep the datasets cache out of the home directory
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        try:
            return load_dataset(builder, data_files=files, split="train", cache_dir=tmp, keep_in_memory=True)
        except Exception as exc:  # datasets raises bare StopIteration / ArrowInvalid on bad files
            raise ValueError(
                f"prompt data {spec} cannot be read as {builder}: {type(exc).__name__}: {exc}"
            ) from exc


def _load_dir(spec: str, cache_dir: str | None):
    """A ``save_to_disk`` directory (a Dataset, or a DatasetDict's train split), else the
    directory's JSONL/Parquet files (one format)."""
    import datasets

    if os.path.isfile(os.path.join(spec, "dataset_info.json")) or os.path.isfile(
        os.path.join(spec, "dataset_dict.json")
    ):
        ds = datasets.load_from_disk(spec, keep_in_memory=True)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"prompt data {spec} holds splits {sorted(ds)} and no 'train' split")
            ds = ds["train"]
        return ds
    files = sorted(
        os.path.join(spec, f)
        for f in os.listdir(spec)
        if os.path.splitext(f)[1].lower() in _BUILDERS and os.path.getsize(os.path.join(spec, f)) > 0
    )
    builders = {_BUILDERS[os.path.splitext(f)[1].lower()] for f in files}
    if not files:
        raise ValueError(
            f"prompt data {spec} is a directory with neither a saved dataset (dataset_info.json) "
            f"nor non-empty .jsonl/.json/.parquet files"
        )
    if len(builders) > 1:
        raise ValueError(f"prompt data {spec} mixes JSON and Parquet files; keep one format per directory")
    return _load_files(spec, builders.pop(), files, cache_dir)


def _from_rows(spec: str, ds, prompt_key: str, answer_key: str) -> list[PromptExample]:
    if len(ds) == 0:
        raise ValueError(f"prompt data {spec} is empty")
    for key in (prompt_key, answer_key):
        if key.split(".")[0] not in ds.column_names:
            raise ValueError(
                f"prompt data {spec} has no column {key.split('.')[0]!r} (columns: {ds.column_names})"
            )
    rows = []
    for i, r in enumerate(ds):
        try:
            prompt = column(r, prompt_key)
            answer = column(r, answer_key)
        except KeyError as exc:
            raise ValueError(
                f"prompt data {spec} row {i}: no {exc.args[0]!r} in {prompt_key!r} or {answer_key!r}"
            ) from None
        if not isinstance(prompt, str):
            prompt = _messages(prompt)
            if prompt is None:
                raise ValueError(
                    f"prompt data {spec} row {i}: column {prompt_key!r} holds neither text nor a list "
                    f"of chat messages ({{'role', 'content'}})"
                )
        if answer is None:
            raise ValueError(f"prompt data {spec} row {i}: column {answer_key!r} is null")
        if isinstance(answer, (dict, list, tuple)):
            raise ValueError(
                f"prompt data {spec} row {i}: column {answer_key!r} holds a {type(answer).__name__} "
                f"({str(answer)[:60]}), not one answer"
                + (
                    f"; name the field inside it: --answer-key {answer_key}.<one of {sorted(answer)}>"
                    if isinstance(answer, dict)
                    else ""
                )
            )
        drop = {prompt_key.split(".")[0]} | ({answer_key} if "." not in answer_key else set())
        rows.append(PromptExample(prompt, str(answer), {k: v for k, v in r.items() if k not in drop}))
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
            raise ValueError(
                f"checkpoint's data sampler was for {state['n']} prompts with seed {state['seed']}, "
                f"this run has {self.n} prompts with seed {self.seed}"
            )
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._perm = self._permutation(self.epoch)
