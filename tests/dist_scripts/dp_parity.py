"""Under torchrun: one forward+backward+AdamW step with Megatron DDP.

Each DP rank takes its slice of a fixed batch of 4 sequences; the loss is the mean token
NLL of the slice (DDP averages over ranks, so DP=N equals DP=1 on the whole batch).
Rank 0 saves the updated parameters. Usage: dp_parity.py CKPT_DIR TP OUT_PT
"""

import sys

import torch

from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, export_hf_state_dict, load_hf_weights
from megatron_spec.parallel import destroy_parallel, init_parallel
from megatron_spec.train.ddp import finalize_grads, wrap_ddp, zero_grads


def main() -> None:
    ckpt_dir, tp, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    info = init_parallel(tp_size=tp, seed=1)
    ckpt = HFCheckpoint(ckpt_dir)
    cfg = ckpt.decoder_config
    model = build_gpt_model(cfg, vocab_divisible_by=8)
    load_hf_weights(model, ckpt)
    ddp = wrap_ddp(model)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)

    g = torch.Generator().manual_seed(0)
    batch = torch.randint(4, cfg.vocab_size, (4, 12), generator=g)
    per_rank = batch.shape[0] // info.dp_size
    ids = batch[info.dp_rank * per_rank:(info.dp_rank + 1) * per_rank]
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    for _ in range(2):
        zero_grads(ddp)
        logits = ddp(ids, pos, attention_mask=None)
        lp = vocab_parallel_token_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=cfg.vocab_size,
                                           tp_group=info.tp_group)
        (-lp.mean()).backward()
        finalize_grads(ddp)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    state = export_hf_state_dict(model)
    if info.rank == 0:
        torch.save({"params": state, "grads": grads}, out_path)
        print(f"OK dp={info.dp_size} tp={tp}")
    destroy_parallel()


if __name__ == "__main__":
    main()
