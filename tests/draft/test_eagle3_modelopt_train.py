"""train_and_export_eagle3: what ModelOpt was asked for, what it exported, and that training learns."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatron_spec.draft import load_eagle3
from megatron_spec.models.hf_config import DecoderConfig

pytestmark = pytest.mark.modelopt


def test_results_and_exported_config(drafts):
    red, full = drafts.reduced, drafts.full
    assert len(red.losses) == 4 and all(len(a) == 2 for a in red.accuracies)  # steps x ttt_steps
    assert red.aux_layer_ids == (0, 1) and full.aux_layer_ids == (0, 1, 2)
    assert (red.draft_vocab_size, full.draft_vocab_size) == (32, 84)
    cfg_red = json.load(open(os.path.join(red.path, "config.json")))
    cfg_full = json.load(open(os.path.join(full.path, "config.json")))
    assert cfg_red["architectures"] == ["LlamaForCausalLMEagle3"]
    # ModelOpt's default export RoPE override vs. export_rope_scaling={} (the plain RoPE it trained with)
    assert cfg_red["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 2048,
    }
    assert cfg_full["rope_scaling"]["rope_type"] == "default"
    assert cfg_red["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    # draft sizes follow the target
    t = drafts.target_cfg
    assert (
        cfg_red["num_attention_heads"],
        cfg_red["num_key_value_heads"],
        cfg_red["head_dim"],
        cfg_red["intermediate_size"],
        cfg_red["rope_theta"],
    ) == (t.num_attention_heads, t.num_kv_heads, t.head_dim, t.intermediate_size, t.rope_theta)


@pytest.mark.parametrize("which", ["reduced", "full"])
def test_input_layernorm_kept_at_ones(drafts, which):
    sd = load_file(os.path.join(getattr(drafts, which).path, "model.safetensors"))
    assert torch.equal(sd["layers.0.input_layernorm.weight"], torch.ones(64))
    assert not torch.equal(sd["layers.0.hidden_norm.weight"], torch.ones(64))  # the others did train


def test_calibration_needs_enough_tokens():
    from megatron_spec.draft.modelopt_train import calibrate_d2t

    d2t = calibrate_d2t([[5, 5, 5, 9, 9, 7]], 3)  # most frequent first: 5, 9, 7
    assert (torch.arange(3) + d2t).tolist() == [5, 9, 7]
    with pytest.raises(ValueError, match="draft_vocab_size 4 needs at least that many distinct tokens"):
        calibrate_d2t([[5, 5, 9, 7]], 4)


def test_rejects_too_short_sequences(drafts, tmp_path):
    from megatron_spec.draft.modelopt_train import train_and_export_eagle3

    with pytest.raises(ValueError, match="at least 5 tokens"):
        train_and_export_eagle3(drafts.target_dir, tmp_path / "x", [[4, 5, 6]], ttt_steps=3, progress=False)


def test_training_learns_and_cli(drafts, tmp_path):
    # A peaky target (large init) on a repetitive corpus: the draft must learn to agree with it. The loss
    # is the soft CE against the target's distribution on the draft vocabulary (floor: its entropy).
    from megatron_spec.draft.modelopt_train import main, train_and_export_eagle3
    from megatron_spec.models.tiny import make_hf_checkpoint

    target = make_hf_checkpoint(tmp_path / "peaky", family="qwen3", num_layers=4, hidden_size=64,
                                intermediate_size=128, init_std=0.3, seed=5)
    g = torch.Generator().manual_seed(11)
    motifs = [torch.randint(4, 84, (6,), generator=g).tolist() for _ in range(3)]
    seqs = [sum((motifs[(i + j) % 3] for j in range(5)), []) for i in range(6)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    out = tmp_path / "learned"
    assert main(["--target", str(target), "--data", str(data), "--out", str(out), "--steps", "0",
                 "--ttt-steps", "1", "--no-export-rope-scaling"]) == 0
    assert json.load(open(out / "config.json"))["rope_scaling"]["rope_type"] == "default"

    res = train_and_export_eagle3(target, out, seqs, steps=25, batch_size=4, ttt_steps=1, lr=1e-2,
                                  draft_vocab_size=12, progress=False, seed=0)
    first, last = sum(res.losses[:3]) / 3, sum(res.losses[-5:]) / 5
    acc_first, acc_last = res.accuracies[0][0], sum(a[0] for a in res.accuracies[-5:]) / 5
    assert last < 0.75 * first, (first, last)
    assert acc_first < 0.3 < 0.6 < acc_last, (acc_first, acc_last)
    head = load_eagle3(out, DecoderConfig.from_pretrained(target))
    assert head.cfg.draft_vocab_size == 12 and set(head.target_ids.tolist()) <= {t for s in seqs for t in s}
