"""Under torchrun: stream a (perturbed) Megatron policy into the native engine, then compare log-probs.

Rank 0 starts a native engine on a *different* checkpoint (so only the sync can make them agree),
streams the policy with :class:`WeightStreamer` (all TP ranks take part in the gathers), samples a
batch (one greedy row, one row at T=0.8) and every TP rank scores the sampled tokens with
Megatron's vocab-parallel log-probs. Asserts (fp32 streaming): engine log-probs == Megatron's within
1e-5. Then the same batch through a bf16-streamed and an FP8-streamed engine: the mismatch is
measured and written out (not asserted small: FP8 changes the policy).
Usage: sync_parity.py CKPT_DIR OTHER_CKPT_DIR TP OUT_JSON
"""

import json
import sys

import torch
import torch.distributed as dist

from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
from megatron_spec.parallel import destroy_parallel, init_parallel
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.native.client import NativeEngine
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from megatron_spec.sync.streamer import WeightStreamer

PROMPT_LEN, NEW = 6, 8
TEMPS = (0.0, 0.8)


def perturb(model) -> None:
    """A deterministic 'training step': the same function of the local index on every rank, so
    replicated parameters stay identical across TP ranks."""
    with torch.no_grad():
        for p in model.parameters():
            i = torch.arange(p.numel(), dtype=torch.float32).view(p.shape)
            p.add_(0.01 * torch.sin(i * 0.37 + 1.0))


def megatron_logprobs(model, seqs: torch.Tensor, info, vocab: int) -> torch.Tensor:
    """Log-probs of the generated tokens ``[B, NEW]`` under Megatron, per-row temperature."""
    pos = torch.arange(seqs.shape[1]).expand_as(seqs)
    with torch.no_grad():
        shard = model(seqs, pos, attention_mask=None)  # [B, S, V_local]
    logits = shard[:, PROMPT_LEN - 1:-1]  # predicts the NEW generated tokens
    temps = torch.tensor(TEMPS, dtype=torch.float32)
    return vocab_parallel_token_logprobs(logits, seqs[:, PROMPT_LEN:], vocab_size=vocab, temperature=temps,
                                         tp_group=info.tp_group)


def run_engine(config: EngineConfig, weight_dtype: str, model, info, prompts, vocab, out, tag, tp):
    """Rank 0: engine + streamer + generate; all ranks: gathers and Megatron scoring."""
    seqs = torch.zeros(len(TEMPS), PROMPT_LEN + NEW, dtype=torch.long)
    engine_lp = None
    if info.rank == 0:
        with NativeEngine(config) as engine:
            streamer = WeightStreamer(
                engine, bucket_bytes=32 << 10, weight_dtype=weight_dtype, measure_memory=True
            )
            rep = streamer.sync_target(model, f"v-{weight_dtype}", tp_group=info.tp_group)
            reqs = [
                GenerateRequest(
                    f"r{i}", p, SamplingParams(temperature=t, max_new_tokens=NEW, ignore_eos=True)
                )
                for i, (p, t) in enumerate(zip(prompts, TEMPS))
            ]
            samples, _ = engine.generate(reqs, seed=7)
            health = engine.health()
        assert health["weight_version"] == f"v-{weight_dtype}"
        for i, s in enumerate(samples):
            seqs[i] = torch.tensor(list(prompts[i]) + s.output_ids)
        engine_lp = torch.tensor([s.logprobs for s in samples])
        out[tag] = {"bytes": rep.bytes, "buckets": rep.num_buckets, "seconds": rep.seconds,
                    "peak_extra_bytes": rep.peak_extra_bytes, "bucket_capacity": rep.bucket_capacity}
    else:
        WeightStreamer(None).sync_target(model, f"v-{weight_dtype}", tp_group=info.tp_group)
    dist.broadcast(seqs, src=0, group=info.tp_group)
    lp = megatron_logprobs(model, seqs, info, vocab)
    if info.rank == 0:
        diff = (engine_lp - lp).abs()
        out[tag].update(max_abs=float(diff.max()), mean_abs=float(diff.mean()))
        print(f"{tag} tp={tp}: engine vs Megatron log-probs max {diff.max():.3e} mean {diff.mean():.3e}")


def main() -> None:
    ckpt_dir, other_dir, tp, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    info = init_parallel(tp_size=tp, seed=1)
    cfg = HFCheckpoint(ckpt_dir).decoder_config
    model = build_gpt_model(cfg, vocab_divisible_by=8)
    load_hf_weights(model, ckpt_dir)
    perturb(model)
    model.eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, cfg.vocab_size, (PROMPT_LEN,), generator=g).tolist() for _ in TEMPS]
    out: dict = {}
    base = dict(model_path=other_dir, num_threads=1, max_batch_size=4, context_length=64)
    run_engine(EngineConfig(**base), "fp32", model, info, prompts, cfg.vocab_size, out, "fp32", tp)
    if info.rank == 0:
        assert out["fp32"]["max_abs"] < 1e-5, f"fp32 sync: log-probs differ by {out['fp32']['max_abs']}"
    run_engine(EngineConfig(**base), "bf16", model, info, prompts, cfg.vocab_size, out, "bf16", tp)
    run_engine(EngineConfig(**base, load_weights=False, fp8_weights=True), "fp8", model, info, prompts,
               cfg.vocab_size, out, "fp8", tp)
    if info.rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)
        print(f"OK tp={tp}")
    destroy_parallel()


if __name__ == "__main__":
    main()
