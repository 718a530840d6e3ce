"""Exactness of the vLLM backend, proven outside it (as ``tests/models/test_real_model.py`` proves ours):
``megatron-spec generate --rollout-backend vllm`` on SmolLM2, the joint of the first two tokens against
transformers' fp32 forward (chi-square; total variation within the bound for N draws), and every sampled
token's log-prob against the processed target distribution it was drawn from.

Accepted and checked here: plain decoding at T=1 and at T=0.7 / top-p 0.9. Speculative decoding at either
is refused on the CPU at start, with one ``error:`` line naming vllm#55005 and the alternatives (its greedy
form is checked token for token against plain decoding in ``test_vllm_backend.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch

from tests.rollout.test_vllm_backend import vllm_or_skip

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module")
def smollm2() -> str:
    vllm_or_skip()
    from megatron_spec.models.fetch import resolve_model

    return resolve_model("smollm2")


@pytest.fixture(scope="module")
def prompt(smollm2) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    return tok.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def generate(
    smollm2, prompt, tmp_path, *extra: str, n: int = 64, requests: int = 16
) -> subprocess.CompletedProcess:
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "input_ids": prompt}) + "\n"
                                              for i in range(requests)))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_spec",
            "generate",
            "--rollout-backend",
            "vllm",
            "--model",
            smollm2,
            "--prompts",
            str(tmp_path / "p.jsonl"),
            "--n",
            str(n),
            "--max-new-tokens",
            "2",
            "--ignore-eos",
            "--seed",
            "7",
            "--batch-size",
            "64",
            "--dtype",
            "float32",
            "--output",
            str(tmp_path / "out.jsonl"),
            "--no-progress",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.statistical
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_plain_sampling_follows_the_real_model(smollm2, prompt, tmp_path, temperature, top_p):
    import transformers

    from megatron_spec.speculative import SamplingTensors, process_logits
    from tests.stats_utils import chi_square_pvalue, total_variation, tv_bound

    n = 64 * 16  # N = 1024 draws (the bounds below are derived from N)
    proc = generate(smollm2, prompt, tmp_path, "--temperature", str(temperature), "--top-p", str(top_p))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == n and len({tuple(r["output_ids"]) for r in rows}) > 10
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    sampling = lambda b: SamplingTensors.from_values(temperature, 0, top_p, 0.0, batch_size=b)
    with torch.no_grad():
        lp1 = process_logits(hf(torch.tensor([prompt])).logits[:, -1], sampling(1))[0]
        # first tokens with mass >= 1e-4 (at most 128; chosen before looking at the draws) keep their second
        # token; the rest of the vocabulary is one cell, and so is each first token's tail of second tokens
        first = [t for t in lp1.argsort(descending=True)[:128].tolist() if lp1[t].exp() >= 1e-4]
        lp2 = process_logits(
            hf(torch.tensor([prompt + [t] for t in first])).logits[:, -1], sampling(len(first))
        )
    p1, p2 = lp1.exp(), lp2.exp()
    row_of = {t: i for i, t in enumerate(first)}
    kept = {t: set((p2[i] >= 1e-5).nonzero()[:, 0].tolist()) for t, i in row_of.items()}
    joint: dict = {("rest",): 1.0 - float(p1[first].sum())}
    for t1, i in row_of.items():
        for t2 in kept[t1]:
            joint[(t1, t2)] = float(p1[t1] * p2[i, t2])
        joint[(t1, "rest")] = float(p1[t1]) * (1.0 - float(p2[i, sorted(kept[t1])].sum()))

    def cell(t1: int, t2: int) -> tuple:
        if t1 not in row_of:
            return ("rest",)
        return (t1, t2) if t2 in kept[t1] else (t1, "rest")

    pairs = Counter(cell(*r["output_ids"][:2]) for r in rows)
    assert chi_square_pvalue(pairs, joint) > 1e-3
    assert total_variation(pairs, joint) < tv_bound(len(joint), n)
    # the log-prob each sample carries is the processed (temperature, top-p, renormalised) target's
    checked = 0
    for r in rows:
        t1, t2 = r["output_ids"][:2]
        assert abs(r["logprobs"][0] - float(lp1[t1])) < 2e-3
        if t1 in row_of:
            assert abs(r["logprobs"][1] - float(lp2[row_of[t1], t2])) < 2e-3
            checked += 1
    assert checked > n // 2


@pytest.mark.parametrize("temperature", ["1.0", "0.7"])
def test_sampled_speculation_is_refused_in_one_line(smollm2, prompt, tmp_path, temperature):
    proc = generate(smollm2, prompt, tmp_path, "--temperature", temperature, "--spec-draft-kind", "ngram",
                    "--spec-num-draft-tokens", "3", n=2, requests=1)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "vllm#55005" in lines[0] and "--rollout-backend native" in lines[0], (
        proc.stderr
    )
