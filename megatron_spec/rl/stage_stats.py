"""The statistics of the policy actor's logprob and train stages (docs/metrics.md).

Each accumulates on the device over the micro-batches of a step, is reduced over the data-parallel
ranks once and read once (one host sync), so the metrics describe the whole step: the train/rollout
log-prob mismatch of the logprob stage (:class:`MismatchStats`) and the GRPO loss statistics of the
train stage (:class:`TrainStats`). They know no model, optimizer or engine: the actor hands them
tensors and the loss's statistics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_spec.parallel import ParallelInfo
from megatron_spec.rl.loss import GRPOLossStats


class MismatchStats:
    """The verifier's old log-probs against the engine's, over the response tokens of a step."""

    def __init__(self, device: torch.device):
        # sum |diff|, tokens compared, tokens out of the support, response tokens; max |diff|
        # (device accumulators: read once, after the loop)
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.diff_max = torch.zeros((), dtype=torch.float64, device=device)

    def add(
        self, old: torch.Tensor, engine_logprobs: torch.Tensor, on: torch.Tensor, inside: torch.Tensor
    ) -> None:
        """One micro-batch. ``old``, ``engine_logprobs``: ``[B, L-1]`` log-probs of the targets;
        ``on``: ``[B, L-1]`` response tokens; ``inside``: those inside the old policy's support."""
        diff = (old - engine_logprobs).abs()[inside].to(torch.float64)
        self.sums += torch.stack(
            [
                diff.sum(),
                inside.sum().to(torch.float64),
                (on & ~inside).sum().to(torch.float64),
                on.sum().to(torch.float64),
            ]
        )
        if diff.numel():  # host sync (the boolean index's size): skips max() of nothing
            self.diff_max = torch.maximum(self.diff_max, diff.max())

    def reduce(self, info: ParallelInfo, counts: torch.Tensor) -> dict[str, float]:
        """The ``mismatch/*`` metrics over every DP rank; ``counts`` (the stage's other per-rank
        counts, float64 on the same device) are summed over the DP ranks in place alongside."""
        if info.dp_size > 1:
            dist.all_reduce(self.sums, group=info.dp_group)
            dist.all_reduce(counts, group=info.dp_group)
            dist.all_reduce(self.diff_max, op=dist.ReduceOp.MAX, group=info.dp_group)
        diff_sum, compared, outside, response = self.sums.tolist()  # the stage's one read of its statistics
        return {
            "mismatch/logprob_abs_diff_max": float(self.diff_max),
            "mismatch/logprob_abs_diff_mean": diff_sum / max(compared, 1.0),
            "mismatch/out_of_support_frac": outside / max(response, 1.0),
        }


class TrainStats:
    """The GRPO loss statistics of a step's micro-batches and the optimizer steps taken."""

    def __init__(self, device: torch.device):
        self.device = device
        # pg, kl, clipped, ratio, tokens, entropy, out of support, samples trained, optimizer steps
        self.sums = torch.zeros(9, dtype=torch.float64, device=device)
        self.ratio_max = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, st: GRPOLossStats, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """One micro-batch's loss statistics; ``entropy``, ``mask``: ``[B, L-1]``."""
        # the loss statistics are host floats (rl/loss.py: one sync per call); entropy and the
        # samples trained stay on the device
        f64, device = torch.float64, self.device
        host = torch.tensor(
            [st.pg_loss_sum, st.kl_sum, st.clipped, st.ratio_sum, st.tokens], dtype=f64, device=device
        )
        self.sums += torch.cat(
            [
                host,
                (entropy * mask).sum().to(f64).reshape(1),
                torch.tensor([st.out_of_support], dtype=f64, device=device),
                (mask.sum(dim=1) > 0).sum().to(f64).reshape(1),
                torch.zeros(1, dtype=f64, device=device),
            ]
        )
        self.ratio_max = torch.maximum(self.ratio_max, torch.tensor(st.ratio_max, dtype=f64, device=device))

    def count_optimizer_step(self, dp_size: int) -> None:
        """Every rank steps: the DP sum counts it once."""
        self.sums[8] += 1.0 / dp_size

    def reduce(self, info: ParallelInfo, *, grad_norm: float, lr: float) -> dict[str, float]:
        """The ``loss/*`` and ``train/*`` metrics over every DP rank (means per response token)."""
        if info.dp_size > 1:
            dist.all_reduce(self.sums, group=info.dp_group)
            dist.all_reduce(self.ratio_max, op=dist.ReduceOp.MAX, group=info.dp_group)
        pg, kl, clipped, ratio, tokens, entropy, outside, samples, steps = self.sums.tolist()
        n = max(tokens, 1.0)
        return {
            "loss/pg": pg / n,
            "loss/kl": kl / n,
            "train/clip_frac": clipped / n,
            "train/ratio_mean": ratio / n,
            "train/ratio_max": float(self.ratio_max),
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/entropy": entropy / n,
            "train/out_of_support_frac": outside / n,
            "train/samples_trained": int(samples),
            "train/optimizer_steps": int(round(steps)),
        }
