"""Instruct-model plumbing on a real BPE tokenizer built here (tests/rl/bpe_chat.py): chat
template, BOS, EOS ids from generation_config.json, stop strings, data folders, the math
reward on GSM8K and boxed answers; and the chat-template path through the GRPO launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megatron_spec.config import ConfigError
from megatron_spec.config_values import parse_stop_strings
from megatron_spec.rl.data import load_prompts
from megatron_spec.rl.prompting import (
    encode_prompt,
    stop_string_end,
    stop_token_ids,
    truncate_at_stop_strings,
)
from megatron_spec.rl.rewards import get_reward
from megatron_spec.rollout.types import SampleOutput
from tests.dist_utils import free_port
from tests.rl.bpe_chat import BOS, EOS, EOT, bpe_tokenizer, make_chat_checkpoint
from tests.rl.test_data_rewards_config import _parse

ROOT = Path(__file__).resolve().parents[2]

GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def test_chat_template_renders_one_bos_and_the_generation_prompt(tok):
    ids = encode_prompt(tok, "What is 3 + 5?", chat_template=True, system_prompt="Be brief.")
    # what transformers' own chat pipeline feeds the model
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is 3 + 5?"}],
                                   tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == list(want)
    bos = tok.convert_tokens_to_ids(BOS)
    assert ids[0] == bos and ids.count(bos) == 1  # the template writes BOS; no second one
    assert tok.decode(ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    with pytest.raises(ValueError, match="has no chat_template"):
        from megatron_spec.models.tiny import char_tokenizer

        encode_prompt(char_tokenizer(), "1+2=", chat_template=True)


def test_prompt_template_wraps_the_prompt_before_the_chat_template(tok):
    q = "Is {x} in f(x) = {1, 2}?"  # braces of the prompt itself stay as they are
    want = encode_prompt(tok, q + " Answer True or False.", chat_template=True)
    assert encode_prompt(tok, q, chat_template=True, template="{prompt} Answer True or False.") == want
    assert encode_prompt(tok, q, chat_template=False, template="Q: {prompt}") == encode_prompt(tok, "Q: " + q,
                                                                                             chat_template=False)


def test_plain_prompts_get_bos_only_where_the_tokenizer_adds_one(tok):
    from megatron_spec.models.tiny import char_tokenizer

    ids = encode_prompt(tok, "What is 3 + 5?", chat_template=False)
    assert (
        ids[0] == tok.convert_tokens_to_ids(BOS)
        and ids[1:] == tok("What is 3 + 5?", add_special_tokens=False)["input_ids"]
    )
    char = char_tokenizer()  # the demo's tokenizer adds nothing: its prompts are unchanged
    assert (
        encode_prompt(char, "3+4=", chat_template=False)
        == char("3+4=", add_special_tokens=False)["input_ids"]
    )


def test_eos_ids_come_from_config_generation_config_and_tokenizer(tmp_path, tok):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert stop_token_ids(str(tmp_path)) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3, 7]}))
    assert stop_token_ids(str(tmp_path)) == (2, 3, 7)
    (tmp_path / "config.json").write_text(json.dumps({}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert stop_token_ids(str(tmp_path), tok) == (tok.eos_token_id, 9)


def test_stop_strings_cut_after_the_completing_token(tok):
    text = "Let me think step by step. The answer is 8. So"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = stop_string_end(tok, ids, ["answer is 8."])
    assert "answer is 8." in tok.decode(ids[:n]) and "answer is 8." not in tok.decode(ids[:n - 1])
    assert stop_string_end(tok, ids, ["nowhere"]) is None
    # the first stop string in the text wins, whichever is listed first
    assert stop_string_end(tok, ids, ["So", "step"]) < stop_string_end(tok, ids, ["So"])
    s = SampleOutput("0", 0, list(ids), [-0.5] * len(ids), "length", 1)
    other = SampleOutput("1", 0, [5, 6], [-1.0, -2.0], "length", 1)
    assert truncate_at_stop_strings([s, other], tok, ["answer is 8."]) == 1
    assert s.output_ids == ids[:n] and s.logprobs == [-0.5] * n and s.finish_reason == "stop"
    assert other.output_ids == [5, 6] and other.finish_reason == "length"


def test_stop_flag_parsing_and_config_checks():
    assert parse_stop_strings(None) == () and parse_stop_strings("\n\n") == ("\n\n",)
    assert parse_stop_strings('["####", "\\n"]') == ("####", "\n") and parse_stop_strings(["a"]) == ("a",)
    with pytest.raises(ValueError, match="not a JSON list"):
        parse_stop_strings("[oops")
    with pytest.raises(ValueError, match="non-empty strings"):
        parse_stop_strings(["a", ""])
    base = ["--hf-checkpoint", "m", "--prompt-data", "synthetic:sum"]
    cfg = _parse(base + ["--apply-chat-template", "--system-prompt", "Be brief.", "--stop", '["\\n"]'])
    assert cfg.data.apply_chat_template and cfg.data.system_prompt == "Be brief."
    with pytest.raises(ConfigError, match="--system-prompt needs --apply-chat-template"):
        _parse(base + ["--system-prompt", "x"])
    assert _parse(base + ["--prompt-template", "{prompt} Answer."]).data.prompt_template == "{prompt} Answer."
    with pytest.raises(ConfigError, match="has no {prompt} placeholder"):
        _parse(base + ["--prompt-template", "Answer."])
    with pytest.raises(ConfigError, match="not a JSON list"):
        _parse(base + ["--stop", "[1,"])


def test_datasets_folders_and_gsm8k_columns(tmp_path):
    import datasets

    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(6)]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    got = load_prompts(str(saved), prompt_key="question", answer_key="answer", cache_dir=str(tmp_path))
    assert [(e.prompt, e.answer) for e in got] == [(r["question"], r["answer"]) for r in rows]
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "test": datasets.Dataset.from_list(rows[4:])}).save_to_disk(str(splits))
    assert len(load_prompts(str(splits), prompt_key="question", cache_dir=str(tmp_path))) == 4
    only_test = tmp_path / "only_test"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(only_test))
    with pytest.raises(ValueError, match="no 'train' split"):
        load_prompts(str(only_test), prompt_key="question", cache_dir=str(tmp_path))
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(2):
        (shards / f"part{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[3 * k:3 * k + 3]))
    got = load_prompts(str(shards), prompt_key="question", cache_dir=str(tmp_path))
    assert [e.prompt for e in got] == [r["question"] for r in rows]
    datasets.Dataset.from_list(rows).to_parquet(str(shards / "more.parquet"))
    with pytest.raises(ValueError, match="mixes JSON and Parquet"):
        load_prompts(str(shards), prompt_key="question", cache_dir=str(tmp_path))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="neither a saved dataset"):
        load_prompts(str(tmp_path / "empty_dir"))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}) + "\n")
    # chat messages (verl's, slime's layout) load as messages (rendered with the chat template later)
    assert load_prompts(str(chat), cache_dir=str(tmp_path))[0].prompt == ({"role": "user", "content": "hi"},)
    chat.write_text(json.dumps({"prompt": [1, 2], "answer": "1"}) + "\n")
    with pytest.raises(
        ValueError, match="row 0: column 'prompt' holds neither text nor a list of chat messages"
    ):
        load_prompts(str(chat), cache_dir=str(tmp_path))


def test_math_reward_takes_gsm8k_and_boxed_answers_as_they_are():
    math = get_reward("math")
    assert math("", "48 + 24 = 72, so #### 72", GSM8K_ANSWER) == 1.0
    assert math("", "so the answer is \\boxed{72}", GSM8K_ANSWER) == 1.0
    assert math("", "the May sales were 24", GSM8K_ANSWER) == 0.0  # an intermediate number is not the answer
    assert math("", "24 clips in May... #### 73", GSM8K_ANSWER) == 0.0
    assert math("", "#### 1234", "#### 1,234") == 1.0
    assert math("", "we get $\\frac{1}{2}$", "\\boxed{0.5}") == 1.0
    assert math("", "-573.6", "-573.6") == 1.0 and math("", "-573.7", "-573.6") == 0.0
    # a one-word reference (mathematics_dataset's comparison answers): the response's last word
    assert math("", "True", "True") == 1.0 and math("", "so it is false.", "False") == 1.0
    assert math("", "False", "True") == 0.0 and math("", "", "True") == 0.0
    out = []  # math-verify's signal timeouts are main-thread only: a worker thread must still work
    t = threading.Thread(target=lambda: out.append(math("", "\\boxed{3}", "3")))
    t.start()
    t.join()
    assert out == [1.0]


def test_native_engine_stops_at_an_eos_id_of_generation_config(tmp_path, tok):
    """Without any stop ids in the request (``megatron-spec generate``, sft_base's accuracy): the
    engine's own EOS ids include generation_config.json's <|eot_id|> (HFCheckpoint.decoder_config)."""
    from megatron_spec.models import HFCheckpoint
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    ckpt = make_chat_checkpoint(str(tmp_path / "ckpt"), eot_bias=0.6)
    eos, eot = tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(EOT)
    assert HFCheckpoint(ckpt).decoder_config.eos_token_ids == (eos, eot)
    srv = EngineServer(EngineConfig(model_path=ckpt, max_batch_size=16, context_length=64, num_threads=1))
    ids = encode_prompt(tok, "What is 3 + 5?", chat_template=True)
    samples, _ = srv.generate(
        [GenerateRequest("0", ids, SamplingParams(temperature=1.0, max_new_tokens=12), n=16)], seed=0
    )
    for s in samples:
        assert not {eos, eot} & set(s.output_ids[:-1]) and (s.finish_reason == "stop") == (
            s.output_ids[-1] == eot
        )
    # p(<|eot_id|>) ~ 0.28 per token: all 16 run 12 tokens without it with probability ~ 0.02**16
    assert sum(s.finish_reason == "stop" for s in samples) >= 12


@pytest.mark.dist
def test_launcher_chat_template_path_stops_at_eot_from_generation_config(tmp_path):
    """GRPO on the BPE checkpoint with --apply-chat-template: the prompts the engine got are the
    template's rendering; <|eot_id|>, an EOS id in generation_config.json only, ends responses
    (without it in the stop ids the native engine runs every response to the length limit);
    the math reward reads the data's GSM8K answers; the held-out evaluation takes the same path."""
    ckpt = make_chat_checkpoint(str(tmp_path / "ckpt"), eot_bias=0.6)
    tok = bpe_tokenizer()
    eot = tok.convert_tokens_to_ids(EOT)
    data = tmp_path / "train.jsonl"
    questions = [f"What is {a} + {b}?" for a in range(1, 5) for b in range(1, 3)]
    data.write_text("".join(json.dumps({"question": q, "answer": f"... #### {eval(q[8:-1])}"}) + "\n"
                            for q in questions))
    run = tmp_path / "run"
    max_new = 12
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(ROOT / "launch" / "pretrain_grpo_spec.py"),
        "--hf-checkpoint",
        ckpt,
        "--prompt-data",
        str(data),
        "--prompt-key",
        "question",
        "--answer-key",
        "answer",
        "--apply-chat-template",
        "--system-prompt",
        "Be brief.",
        "--reward",
        "math",
        "--eval-data",
        str(data),
        "--eval-interval",
        "2",
        "--eval-prompts",
        "4",
        "--make-vocab-size-divisible-by",
        "8",
        "--prompts-per-step",
        "4",
        "--grpo-group-size",
        "2",
        "--micro-batch-size",
        "4",
        "--train-iters",
        "2",
        "--rollout-max-new-tokens",
        str(max_new),
        "--rollout-max-batch-size",
        "8",
        "--rollout-num-threads",
        "1",
        "--rollout-dtype",
        "float32",
        "--rollout-backend",
        "native",
        "--max-prompt-length",
        "64",
        "--lr",
        "1e-3",
        "--save",
        str(run),
        "--quiet",
        "--tensorboard-dir",
        "none",
        "--dump-rollouts",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(x) for step in (1, 2)
            for x in (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    assert len(rows) == 16
    rendered = {
        tuple(encode_prompt(tok, q, chat_template=True, system_prompt="Be brief.")) for q in questions
    }
    assert all(tuple(r["prompt_ids"]) in rendered for r in rows)
    stops = {eot, tok.convert_tokens_to_ids(EOS)}
    for r in rows:
        out = r["response_ids"]
        assert not stops & set(out[:-1]), f"generation went on past an EOS id: {out}"
        assert (r["finish_reason"] == "stop") == (out[-1] in stops) and len(out) <= max_new
    # p(<|eot_id|>) is about 0.28 per token: P(12 tokens without it) ~ 0.72**12 = 0.02 per response
    stopped = sum(r["finish_reason"] == "stop" for r in rows)
    assert stopped >= 12, f"only {stopped}/16 responses stopped at an EOS id"
    m = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert m[-1]["eval_final/prompts"] == 4 and all(0.0 <= r["reward/mean"] <= 1.0 for r in m)
