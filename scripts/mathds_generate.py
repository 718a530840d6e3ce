"""Write DeepMind mathematics_dataset problems as JSONL (run by scripts/make_math_task.sh).

Runs in the separate environment .venv-mathds (mathematics_dataset 1.0.1 needs sympy 1.5.1,
which torch's sympy requirement excludes from the project's .venv). For each module and split it
writes ``<out>/<module>/<split>.jsonl`` with rows ``{"question", "answer", "module", "split"}``,
the generator's own question and answer text. Splits: ``train-easy`` / ``train-medium`` /
``train-hard`` (the thirds of the training entropy range, as the released data set has them),
``train`` (the whole range), ``interpolate`` (the held-out test set at training difficulty) and
``extrapolate`` (harder: the module itself or its ``_big`` / ``_longer`` / ``_more`` variant, written
under the module's own folder; modules with none are skipped). Questions and answers longer than the
generator's limits are dropped as its own ``generate`` does. Every (module, split) is drawn from
its own seed, so the files do not depend on which others are asked for.

It imports nothing of megatron-spec (that package lives in the other environment).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import zlib

import numpy as np
from mathematics_dataset import generate_settings
from mathematics_dataset.modules import modules

LEVELS = {"train-easy": 0, "train-medium": 1, "train-hard": 2}
EXTRAPOLATE_SUFFIXES = ("", "_big", "_longer", "_more")


def _entropy_fn(level: int | None, num_levels: int = 3):
    """mathematics_dataset.generate's restriction of the training entropy range to one third."""
    def fn(range_):
        if level is None:
            return range_
        length = range_[1] - range_[0]
        return (range_[0] + level / num_levels * length, range_[0] + (level + 1) / num_levels * length)
    return fn


def _flatten(tree, prefix=None) -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}__{key}" if prefix else key
        if isinstance(value, dict):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def _split_modules(split: str) -> dict:
    if split in LEVELS:
        return _flatten(modules.train(_entropy_fn(LEVELS[split])))
    if split == "train":
        return _flatten(modules.train(_entropy_fn(None)))
    if split == "interpolate":
        return _flatten(modules.test())
    if split == "extrapolate":
        return _flatten(modules.test_extra())
    raise SystemExit(
        f"unknown split {split!r}; expected one of {sorted(LEVELS) + ['train', 'interpolate', 'extrapolate']}"
    )


def sample(module_fn, n: int, seed: int) -> list[tuple[str, str]]:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    out, tries = [], 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n + 100:
            raise SystemExit(f"could not draw {n} problems within the length limits ({len(out)} drawn)")
        problem = module_fn()
        q, a = str(problem.question), str(problem.answer)
        if len(q) > generate_settings.MAX_QUESTION_LENGTH or len(a) > generate_settings.MAX_ANSWER_LENGTH:
            continue
        out.append((q, a))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modules", default="arithmetic__add_or_sub,numbers__gcd,algebra__linear_1d",
                    help="comma-separated full module names (exact, e.g. numbers__gcd)")
    ap.add_argument("--splits", default="train-easy,interpolate,extrapolate")
    ap.add_argument("--num-train", type=int, default=2000, help="problems per module in a train* split")
    ap.add_argument(
        "--num-test", type=int, default=500, help="problems per module in interpolate/extrapolate"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for split in args.splits.split(","):
        available = _split_modules(split)
        for name in args.modules.split(","):
            source = name
            if split == "extrapolate":  # the harder variant has its own name: numbers__place_value_big
                source = next((name + sfx for sfx in EXTRAPOLATE_SUFFIXES if name + sfx in available), None)
                if source is None:
                    print(f"[mathds] {name}: no extrapolate variant (that split's modules: "
                          f"{sorted(k for k in available if k.startswith(name.split('__')[0]))})")
                    continue
            elif name not in available:
                raise SystemExit(f"unknown module {name!r} in split {split}; known: {sorted(available)}")
            n = args.num_train if split.startswith("train") else args.num_test
            seed = zlib.crc32(f"{args.seed}/{name}/{split}".encode())
            rows = sample(available[source], n, seed)
            path = os.path.join(args.out, name, f"{split}.jsonl")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                for q, a in rows:
                    f.write(json.dumps({"question": q, "answer": a, "module": source, "split": split}) + "\n")
            os.replace(path + ".tmp", path)
            print(f"[mathds] {path}: {len(rows)} problems")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
