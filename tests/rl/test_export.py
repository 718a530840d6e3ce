"""The trained policy leaves the run (``rl/export.py``): ``--save-hf`` at the end of a GRPO run and
``megatron-spec export-hf`` from its checkpoint write the same HF folder, at TP=1 and TP=2; transformers
loads it with logits equal to the Megatron policy's (fp32, < 1e-4 relative); our engine serves it with the
exported draft, speculative greedy equal to plain greedy; bad paths are one ``error:`` line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.rl.test_grpo_e2e import grpo

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.dist


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "megatron_spec", *args], capture_output=True, text=True,
                          timeout=600, cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def same_folder(a: Path, b: Path) -> None:
    """The policy's tensors bit for bit, every other file byte for byte (export.json names its own origin)."""
    names = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
    assert names(a) == names(b)
    ta, tb = tensors(a / "policy"), tensors(b / "policy")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    for rel in names(a):
        if not rel.endswith((".safetensors", "export.json")):
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def megatron_logits(target: str, iter_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """The checkpoint's policy in a Megatron GPTModel of its own (TP=1 whatever TP it was saved at:
    megatron-core
    reshards it; a subprocess: megatron-core's state stays out of this one)."""
    logits = iter_dir.parent / "logits.pt"
    script = f"""
import torch
from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model
from megatron_spec.parallel import init_parallel
from megatron_spec.rl.checkpoint import load_checkpoint
init_parallel(tp_size=1, seed=0)
cfg = HFCheckpoint({target!r}).decoder_config
model = build_gpt_model(cfg, params_dtype=torch.float32, vocab_divisible_by=8)
model.load_state_dict(load_checkpoint({str(iter_dir)!r}, {{"model": model.sharded_state_dict()}})["model"])
model.eval()
ids = torch.tensor({ids.tolist()!r})
with torch.no_grad():
    out = model(ids, torch.arange(ids.shape[1]).unsqueeze(0), attention_mask=None)[..., :cfg.vocab_size]
torch.save(out, {str(logits)!r})
"""
    subprocess.run(
        [sys.executable, "-c", script],
        check=True,
        cwd=str(ROOT),
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=300,
        capture_output=True,
    )
    return torch.load(logits)


@pytest.mark.parametrize("tp", [1, 2])
def test_save_hf_equals_export_hf_and_loads_in_transformers(setup, tmp_path, tp):
    import transformers

    run = tmp_path / "run"
    grpo(
        setup,
        run,
        "--train-iters",
        "2",
        "--spec-draft-kind",
        "eagle3",
        "--spec-draft-path",
        setup.eagle3,
        "--spec-online-draft-training",
        "--tensor-model-parallel-size",
        str(tp),
        "--rollout-dtype",
        "float32",
        nproc=tp,
    )
    saved = run / "hf"
    record = json.loads((saved / "export.json").read_text())
    assert record["step"] == 2 and record["policy_version"] == 2 and record["draft"] == "eagle3"
    assert (saved / "eagle3" / "model.safetensors").exists() and (saved / "policy" / "config.json").exists()

    out = tmp_path / "export"
    proc = cli("export-hf", str(run), "--out", str(out))
    assert proc.stdout.strip() == str(out / "policy")
    same_folder(saved, out)  # the end of the run and the command: one folder
    # the exported draft is the checkpoint's (the online-trained one of the last step)
    assert (out / "eagle3" / "model.safetensors").read_bytes() == \
        (run / "iter_0000002" / "draft" / "model.safetensors").read_bytes()

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out / "policy"), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(out / "policy"))
    ids = torch.tensor([tok("What is 12 plus 30?")["input_ids"]])
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits.float()
    assert tok.chat_template == transformers.AutoTokenizer.from_pretrained(setup.target).chat_template
    ours = megatron_logits(setup.target, run / "iter_0000002", ids).float()
    rel = ((ours - theirs).norm() / theirs.norm()).item()
    assert rel < 1e-4, f"exported logits differ from the Megatron policy's by {rel:.2e} (relative)"
    # and training changed them: the export is the trained policy, not the start
    start = transformers.AutoModelForCausalLM.from_pretrained(setup.target, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.allclose(start(input_ids=ids).logits, theirs)


def test_our_engine_serves_the_export_with_its_draft(setup, tmp_path):
    run = tmp_path / "run"
    grpo(setup, run, "--train-iters", "1", "--spec-draft-kind", "eagle3", "--spec-draft-path", setup.eagle3,
         "--rollout-dtype", "float32")
    policy, draft = run / "hf" / "policy", run / "hf" / "eagle3"
    # the static draft, copied
    assert json.loads((run / "hf" / "export.json").read_text())["draft"] == "eagle3"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in
                               enumerate(["What is 3 plus 4?", "Add 10 and 21.", "Sum of 7 and 8?"])))
    got = {}
    for kind in ("eagle3", "none"):
        extra = ["--spec-draft-path", str(draft)] if kind == "eagle3" else []
        out = tmp_path / f"{kind}.jsonl"
        proc = cli(
            "generate",
            "--hf-checkpoint",
            str(policy),
            "--prompts",
            str(prompts),
            "--output",
            str(out),
            "--spec-draft-kind",
            kind,
            *extra,
            "--rollout-temperature",
            "0",
            "--rollout-max-new-tokens",
            "16",
            "--rollout-dtype",
            "float32",
            "--no-progress",
        )
        got[kind] = {json.loads(x)["id"]: json.loads(x)["output_ids"] for x in out.read_text().splitlines()}
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        if kind == "eagle3":
            assert summary["mean_accept_length"] > 1.0  # the exported draft drafts for the exported policy
    assert got["eagle3"] == got["none"]


def test_export_hf_bad_paths_are_one_line(setup, tmp_path):
    for path, message in ((tmp_path / "missing", "no such folder"),
                          (tmp_path, "holds no checkpoint")):
        proc = cli("export-hf", str(path), "--out", str(tmp_path / "out"), check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("megatron-spec export-hf: error: ")
        assert message in proc.stderr
    partial = tmp_path / "iter_0000001"
    partial.mkdir()
    (partial / "trainer_state.json").write_text("{}")
    proc = cli("export-hf", str(partial), "--out", str(tmp_path / "out"), check=False)
    assert proc.returncode == 2 and "not a complete checkpoint" in proc.stderr
