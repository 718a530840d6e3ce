"""Under torchrun (2 ranks, trainer TP=2): one payload per engine TP rank, each packed by its own rank.

Both ranks are the senders of one engine of tensor parallelism 2 (``megatron_spec.sync.forward``):
each all-gathers the policy over the trainer TP group, packs every bucket into its own buffers and
makes its own payload; rank 0 (the owner) gathers the two payloads of each bucket and hands them to
the engine as one list. The engine here is the native engine behind :class:`TwoRankEngine`, which
plays an engine with two TP ranks: it checks that it got two payloads, from two different buffers
(two processes' shared memory), and loads the one *rank 1* packed. The
owner's streamer then verifies the engine's checksum against what rank 0 packed, and the engine's
greedy log-probs must equal Megatron's: rank 1's forwarded payload carried the policy.
Usage: forward_payloads.py CKPT_DIR OTHER_CKPT_DIR OUT_JSON
"""

import json
import sys

import torch
import torch.distributed as dist

from megatron_spec.interfaces import WeightReceiver
from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
from megatron_spec.parallel import destroy_parallel, init_parallel
from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.native.client import NativeEngine
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from megatron_spec.sync.forward import ForwardedCallError, PayloadForwarder, PayloadGather
from megatron_spec.sync.streamer import WeightStreamer
from megatron_spec.sync.transport import read_bucket_payload

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from sync_parity import NEW, PROMPT_LEN, TEMPS, megatron_logprobs, perturb


class TwoRankEngine(WeightReceiver):
    """The native engine seen as an engine of two TP ranks (see the module docstring)."""

    tp_size = 2

    def __init__(self, engine: NativeEngine):
        self.engine = engine
        self.config = engine.config
        self.calls = 0
        self.fail_next = False

    def begin_weight_update(self, selector="all"):
        return self.engine.begin_weight_update(selector)

    def update_weights_from_tensor(self, payloads, selector, weight_version=None, flush_cache=True):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected: engine refused the bucket")
        assert len(payloads) == 2, f"expected one payload per engine TP rank, got {len(payloads)}"
        assert payloads[0] != payloads[1], "both payloads name the same buffer: rank 1 did not pack its own"
        # each payload is opened exactly once (it hands over one reference to its buffer): rank 0's
        # here, rank 1's by the engine; the owner's streamer then checks the engine's checksum
        # against what rank 0 packed, so the two ranks' buckets must be equal
        assert read_bucket_payload(payloads[0]), "rank 0's payload is empty"
        self.calls += 1
        return self.engine.update_weights_from_tensor([payloads[1]], selector, weight_version, flush_cache)

    def end_weight_update(self):
        return self.engine.end_weight_update()

    def abort_weight_update(self):
        return self.engine.abort_weight_update()

    def health(self, timeout=60.0):
        return self.engine.health(timeout)


def main() -> None:
    ckpt_dir, other_dir, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    info = init_parallel(tp_size=2, seed=1)
    cfg = HFCheckpoint(ckpt_dir).decoder_config
    model = build_gpt_model(cfg, vocab_divisible_by=8)
    load_hf_weights(model, ckpt_dir)
    perturb(model)
    model.eval()
    group = dist.new_group(ranks=[0, 1], backend="gloo")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, cfg.vocab_size, (PROMPT_LEN,), generator=g).tolist() for _ in TEMPS]
    seqs = torch.zeros(len(TEMPS), PROMPT_LEN + NEW, dtype=torch.long)
    out = {}
    engine = None
    if info.rank == 0:
        engine = TwoRankEngine(
            NativeEngine(
                EngineConfig(model_path=other_dir, num_threads=1, max_batch_size=4, context_length=64)
            )
        )
        streamer = WeightStreamer(
            PayloadGather(engine, group, 0, 2), bucket_bytes=32 << 10, weight_dtype="fp32"
        )
    else:
        streamer = WeightStreamer(PayloadForwarder(group, 0), bucket_bytes=32 << 10, weight_dtype="fp32",
                                  verify=False, engine_dtype=torch.float32)
    rep = streamer.sync_target(model, "v1", tp_group=info.tp_group)
    if info.rank == 0:
        out.update(buckets=rep.num_buckets, calls=engine.calls)
        assert engine.calls == rep.num_buckets > 1, (engine.calls, rep.num_buckets)
        reqs = [
            GenerateRequest(f"r{i}", p, SamplingParams(temperature=t, max_new_tokens=NEW, ignore_eos=True))
            for i, (p, t) in enumerate(zip(prompts, TEMPS))
        ]
        samples, _ = engine.engine.generate(reqs, seed=7)
        for i, s in enumerate(samples):
            seqs[i] = torch.tensor(list(prompts[i]) + s.output_ids)
        engine_lp = torch.tensor([s.logprobs for s in samples])
    dist.broadcast(seqs, src=0)
    lp = megatron_logprobs(model, seqs, info, cfg.vocab_size)
    if info.rank == 0:
        out["max_abs"] = float((engine_lp - lp).abs().max())
        assert out["max_abs"] < 1e-5, out

    # an error in the owner's engine call reaches the other sender as an error, not a hang
    if info.rank == 0:
        engine.fail_next = True
    try:
        streamer.sync_target(model, "v2", tp_group=info.tp_group)
        raised = None
    except Exception as exc:
        raised = exc
    assert raised is not None, "the failed bucket must fail the sync on every sender"
    if info.rank == 1:
        assert isinstance(raised.__cause__, ForwardedCallError) or "injected" in str(raised), raised
    flags = [None, None]
    dist.all_gather_object(flags, type(raised).__name__)
    if info.rank == 0:
        out["error_types"] = flags
        engine.engine.shutdown()
        with open(out_path, "w") as f:
            json.dump(out, f)
        print("OK forward_payloads")
    destroy_parallel()


if __name__ == "__main__":
    main()
