"""Under torchrun: vocab-parallel support masks and log-probs equal process_logits on the full row.

For several (temperature, top_k, top_p, min_p) settings, random logits [B, S, V] are split
across the TP ranks (padded vocabulary); each rank's exclude mask must equal the slice of
``~isfinite(process_logits(full))`` and the token log-probs must equal those of
``process_logits`` within 1e-5. Usage: support_parity.py TP
"""

import sys

import torch

from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
from megatron_spec.capture.support import vocab_parallel_support_mask
from megatron_spec.parallel import destroy_parallel, init_parallel
from megatron_spec.speculative import SamplingTensors, process_logits

SETTINGS = [
    (1.0, 5, 1.0, 0.0),
    (0.7, 8, 0.8, 0.05),
    (1.3, 0, 0.9, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.5, 3, 1.0, 0.0),
]


def main() -> None:
    tp = int(sys.argv[1])
    info = init_parallel(tp_size=tp, seed=0)
    g = torch.Generator().manual_seed(7)
    b, s, vocab, padded = 3, 4, 50, 64
    full = torch.randn(b, s, vocab, generator=g) * 3
    full[0, 0, :4] = full[0, 0].max()  # ties at the top
    padded_full = torch.cat([full, torch.full((b, s, padded - vocab), 123.0)], -1)  # padding must never count
    local = padded // tp
    shard = padded_full[..., info.tp_rank * local:(info.tp_rank + 1) * local]
    for temperature, top_k, top_p, min_p in SETTINGS:
        ref = process_logits(full.reshape(-1, vocab),
                             SamplingTensors.from_values(temperature, top_k, top_p, min_p, batch_size=b * s))
        ref = ref.view(b, s, vocab)
        mask = vocab_parallel_support_mask(shard, vocab_size=vocab, temperature=temperature, top_k=top_k,
                                           top_p=top_p, min_p=min_p, tp_group=info.tp_group)
        ref_mask = torch.cat([~torch.isfinite(ref), torch.ones(b, s, padded - vocab, dtype=torch.bool)], -1)
        ref_local = ref_mask[..., info.tp_rank * local:(info.tp_rank + 1) * local]
        assert mask is not None and torch.equal(mask, ref_local), (temperature, top_k, top_p, min_p)
        # score the argmax and a random kept token of each row
        tokens = ref.argmax(-1)
        lp = vocab_parallel_token_logprobs(shard, tokens, vocab_size=vocab, temperature=temperature,
                                           exclude_mask=mask, tp_group=info.tp_group)
        want = ref.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        assert (lp - want).abs().max().item() < 1e-5, (temperature, top_k, top_p, min_p)
    assert vocab_parallel_support_mask(shard, vocab_size=vocab, temperature=0.0, top_k=5) is None
    if info.rank == 0:
        print(f"OK tp={tp}")
    destroy_parallel()


if __name__ == "__main__":
    main()
