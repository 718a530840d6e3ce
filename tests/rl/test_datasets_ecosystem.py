"""The datasets RL users already have (``rl/data.py``, ``rl/prompting.py``): verl's parquet layout (a prompt
that is a list of chat messages, the answer nested in ``reward_model.ground_truth``), chat-template
variables, overlong prompts dropped at load; end to end through a GRPO step on a verl-format file."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_spec.rl.data import load_prompts
from megatron_spec.rl.prompting import encode_prompt, parse_template_kwargs
from megatron_spec.rl.synthetic_tasks import generate
from tests.dist_utils import free_port
from tests.rl.bpe_chat import bpe_tokenizer, make_chat_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def verl_parquet(path: Path, n: int = 24, seed: int = 0) -> list:
    """A GSM8K-style file as verl's preprocessing writes it (examples/data_preprocess/gsm8k.py's columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = generate("sum", n, seed)
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "data_source": "openai/gsm8k",
                    "prompt": [{"role": "user", "content": ex.prompt}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": ex.answer},
                    "extra_info": {"split": "train", "index": i},
                }
                for i, ex in enumerate(rows)
            ]
        ),
        str(path),
    )
    return rows


def test_verl_layout_loads(tmp_path):
    rows = verl_parquet(tmp_path / "train.parquet")
    got = load_prompts(
        str(tmp_path / "train.parquet"), prompt_key="prompt", answer_key="reward_model.ground_truth"
    )
    assert [e.answer for e in got] == [r.answer for r in rows]
    assert got[0].prompt == ({"role": "user", "content": rows[0].prompt},)
    with pytest.raises(ValueError, match=r"column 'reward_model' holds a dict .* --answer-key "
                                         r"reward_model.<one of \['ground_truth', 'style'\]>"):
        load_prompts(str(tmp_path / "train.parquet"), prompt_key="prompt", answer_key="reward_model")
    with pytest.raises(ValueError, match="no 'truth'"):
        load_prompts(str(tmp_path / "train.parquet"), prompt_key="prompt", answer_key="reward_model.truth")
    with pytest.raises(ValueError, match="neither text nor a list of chat messages"):
        load_prompts(str(tmp_path / "train.parquet"), prompt_key="extra_info", answer_key="ability")


def hub_cache(root: Path, repo: str, configs: dict[str, dict[str, list]], readme: bool = True) -> Path:
    """A Hugging Face Hub cache filled by hand, as ``hf download REPO --repo-type dataset`` leaves it:
    ``datasets--org--name/refs/main`` naming a snapshot that holds one parquet file per config and split,
    and the README's ``configs`` saying which is which."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = root / f"datasets--{repo.replace('/', '--')}"
    snap = folder / "snapshots" / commit
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    card = ["---", "configs:"]
    for config, splits in configs.items():
        card += [f"- config_name: {config}", "  data_files:"]
        for split, rows in splits.items():
            (snap / config).mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows), str(snap / config / f"{split}-00000-of-00001.parquet"))
            card += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    if readme:
        (snap / "README.md").write_text("\n".join(card + ["---", ""]))
    return root


def test_hub_dataset_names_read_the_local_cache_offline(tmp_path, monkeypatch):
    """``org/name[:config][@split]`` from a cache filled by hand, with the Hub out of reach (offline)."""
    import huggingface_hub.constants

    from megatron_spec.config import ConfigError, from_args
    from megatron_spec.rl.preflight import check_inputs

    rows = {c: {s: [{"question": f"{c} {s} {i}", "answer": f"#### {i}"} for i in range(n)]
                for s, n in (("train", 5), ("test", 2))} for c in ("main", "socratic")}
    monkeypatch.setattr(
        huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "hub", "acme/gsm8k", rows))
    )
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    got = load_prompts("acme/gsm8k:main", prompt_key="question")
    assert [(e.prompt, e.answer) for e in got] == [(f"main train {i}", f"#### {i}") for i in range(5)]
    got = load_prompts("acme/gsm8k:socratic@test", prompt_key="question")
    assert [e.prompt for e in got] == ["socratic test 0", "socratic test 1"]
    # split names from the files
    hub_cache(tmp_path / "hub", "acme/one", {"default": rows["main"]}, readme=False)
    assert len(load_prompts("acme/one", prompt_key="question")) == 5
    for spec, message in (("acme/gsm8k", "Config name is missing"), ("acme/gsm8k:nope", "'nope' not found"),
                          ("acme/gsm8k:main@dev", "split dev"),
                          ("acme/absent", "not in the local Hugging Face cache")):
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            load_prompts(spec, prompt_key="question")
    with pytest.raises(ConfigError, match="--prompt-data acme/absent: the Hub dataset acme/absent is not "
                                          "in the local Hugging Face cache.*hf download acme/absent"):
        check_inputs(from_args(argparse.Namespace(**_flags("acme/absent"))), 1)


def _flags(prompt_data: str) -> dict:
    import argparse as _argparse

    from megatron_spec.config import add_arguments

    p = _argparse.ArgumentParser()
    add_arguments(p)
    return vars(p.parse_args(["--hf-checkpoint", "smollm2", "--prompt-data", prompt_data]))


def test_message_prompts_render_like_text_prompts():
    tok = bpe_tokenizer()
    text = "What is 3 + 5?"
    as_text = encode_prompt(
        tok, text, chat_template=True, system_prompt="Be brief.", template="{prompt} Think."
    )
    as_messages = encode_prompt(tok, ({"role": "user", "content": text},), chat_template=False,
                                system_prompt="Be brief.", template="{prompt} Think.")
    assert as_text == as_messages
    # a system turn of the data's own stays, and the flag's is not added twice
    own = encode_prompt(tok, ({"role": "system", "content": "Mine."}, {"role": "user", "content": text}),
                        chat_template=True, system_prompt="Be brief.")
    assert "Mine." in tok.decode(own) and "Be brief." not in tok.decode(own)
    assert parse_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    assert parse_template_kwargs(None) == {}
    with pytest.raises(ValueError, match="JSON object"):
        parse_template_kwargs("[1]")


BAR_REWARD = """
def gsm8k_digits(prompt, response, answer, metadata):
    # reads the dataset's own columns: a row without them is a broken pipeline, not a zero reward
    if metadata["data_source"] != "openai/gsm8k" or "index" not in metadata["extra_info"]:
        raise ValueError(f"metadata missing: {sorted(metadata)}")
    return sum(c.isdigit() for c in response) / max(1, len(response))
"""


@pytest.mark.dist
def test_verl_parquet_run_killed_resumed_and_exported(tmp_path):
    """The user's data in, the trained model out (issue 54's bar): GRPO on a verl-format parquet (message
    prompts, ``reward_model.ground_truth``, a metadata column read by a ``file.py:function`` reward), a YAML
    written the NeMo-RL way (``lr: 1e-5``, unprefixed keys) and a dotted override, two overlong prompts
    dropped
    at load; ``kill -9`` after step 2's checkpoint, the same command again resumes and finishes; ``export-hf``
    of the run loads in transformers with logits equal to the Megatron policy's (fp32, < 1e-4) and equals the
    run's own ``--save-hf`` folder."""
    import signal
    import time

    import psutil
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import transformers

    from tests.rl.test_export import cli, megatron_logits, same_folder

    model = make_chat_checkpoint(str(tmp_path / "model"))
    data = tmp_path / "train.parquet"
    verl_parquet(data)
    table = pq.read_table(str(data)).to_pylist()
    for row in table[:2]:
        row["prompt"][0]["content"] = "Add these: " + " + ".join(str(i) for i in range(80))
    pq.write_table(pa.Table.from_pylist(table), str(data))
    (tmp_path / "my_reward.py").write_text(BAR_REWARD)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "data:\n  prompt_key: prompt\n  answer_key: reward_model.ground_truth\n  max_prompt_length: 96\n"
        f"  reward: {tmp_path / 'my_reward.py'}:gsm8k_digits\n"
        "grpo:\n  lr: 1e-5\n  group_size: 2\n  prompts_per_step: 2\n  micro_batch_size: 4\n"
        "rollout:\n  max_new_tokens: 8\n  max_batch_size: 8\n  dtype: float32\n"
        "checkpoint:\n  save_interval: 1\n"
    )
    run = tmp_path / "run"
    steps = 6
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(ROOT / "launch" / "pretrain_grpo_spec.py"),
        "--config",
        str(cfg),
        "--hf-checkpoint",
        model,
        "--prompt-data",
        str(data),
        "--make-vocab-size-divisible-by",
        "8",
        "--save",
        str(run),
        "--quiet",
        "--tensorboard-dir",
        "none",
        "--dump-rollouts",
        "--rollout-num-threads",
        "1",
        f"grpo.train_iters={steps}",
        'data.apply_chat_template_kwargs={"unused_variable": true}',
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    first = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    latest = run / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 600
    while not (latest.exists() and int(latest.read_text() or 0) >= 2):
        assert first.poll() is None, first.stderr.read()[-4000:]
        assert time.monotonic() < deadline, "no checkpoint of step 2 in 600 s"
        time.sleep(0.05)
    # kill -9 of the launcher, its workers and their engines at once (torchrun's workers have their own
    # process groups: a signal to the launcher's alone leaves them running)
    job = psutil.Process(first.pid)
    for p in [job, *job.children(recursive=True)]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    first.wait()
    killed_at = int(latest.read_text())
    assert killed_at < steps and not (run / "hf").exists(), "the run finished before it was killed"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(ROOT), env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resuming from {run / f'iter_{killed_at:07d}'}" in proc.stderr
    assert "dropped 2 of 24 prompts longer than --max-prompt-length 96" in proc.stderr
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
    saved = (run / "config.yaml").read_text()
    assert "lr: 1.0e-05" in saved and "answer_key: reward_model.ground_truth" in saved
    dumped = [json.loads(x) for x in (run / "rollouts" / f"step_{steps:06d}.jsonl").read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(model)
    assert all(
        tok.decode(r["prompt_ids"]).startswith("<|begin_of_text|><|start_header_id|>user") for r in dumped
    )

    out = tmp_path / "export"
    cli("export-hf", str(run), "--out", str(out))
    same_folder(run / "hf", out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out / "policy"), dtype=torch.float32).eval()
    ids = torch.tensor(
        [
            tok.apply_chat_template(
                [{"role": "user", "content": "What is 12 + 30?"}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        ]
    )
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits.float()
    ours = megatron_logits(model, run / f"iter_{steps:07d}", ids).float()
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    assert rel < 1e-4, f"exported logits differ from the Megatron policy's by {rel:.2e} (relative)"
