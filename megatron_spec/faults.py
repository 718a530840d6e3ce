"""Fault injection for the fault-tolerance tests (off unless ``MEGATRON_SPEC_FAULTS`` is set), and the
test hooks: modes only tests use, kept out of the flags (off unless ``MEGATRON_SPEC_TEST_HOOKS`` is set).

``MEGATRON_SPEC_FAULTS="kill_in_save=3,engine_exit_at_generate=2"`` makes the named point
fail the given time it is reached: ``kill_in_save`` SIGKILLs the trainer after its rank file
of the checkpoint for step N is written and before the checkpoint is complete;
``engine_exit_at_generate`` makes the engine process exit abruptly at its N-th generate call
(``engine<E>_exit_at_generate``: only engine E of a job of several, ``--rollout-num-engines``;
``engine<E>_stall_at_generate`` makes it hang there instead); ``engine_kill_in_generate`` (and
``engine<E>_kill_in_generate``) SIGKILLs the vLLM engine process half a second into its N-th generate call;
``nan_loss`` turns the GRPO loss of step N into NaN; ``corrupt_draft`` replaces the online-trained
draft's weights by large random ones right after its update of step N (:func:`corrupt_weights`:
the next step's rollouts draft garbage, the acceptance watchdog's test). Each fires once per run when
``MEGATRON_SPEC_FAULTS_DIR`` is set (a marker file there records that it fired).

Real failures come without warning; these points exist so tests can show what the run does
when a process dies at the worst moment.

``MEGATRON_SPEC_TEST_HOOKS="history_tree_always"`` (:func:`test_hook`): the adaptive controller makes
every step a tree step where a row has a history proposal, with the whole proposal as the second
branch (the exactness and distribution tests of tree steps, which the cost model alone would run
only where they pay); ``history_rows_always``: in a step where every row drafts, each row with a
history proposal (finished responses or the live group index) drafts from it, beside rows drafting
from the main drafter, whatever the cost model prefers (the distribution test of mixed steps at T=1,
where the controller, rightly, seldom picks the history on a model trained from scratch);
``vllm_stale_tied_head``: the vLLM worker skips re-packing a tied LM head after a weight update (the
defect ``rollout.vllm_worker.tied_layers`` works around; the fingerprints still match, the tokens do
not: the test of ``--rollout-reference-check``). Engine processes inherit the variable.
"""

from __future__ import annotations

import os
import signal


def _config() -> dict[str, int]:
    spec = os.environ.get("MEGATRON_SPEC_FAULTS", "")
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, value = item.partition("=")
        out[name] = int(value or 1)
    return out


def should_fire(point: str, count: int) -> bool:
    """True when ``point`` is configured to fail at ``count`` and has not fired in this run."""
    cfg = _config()
    if cfg.get(point) != count:
        return False
    marker_dir = os.environ.get("MEGATRON_SPEC_FAULTS_DIR")
    if marker_dir:
        marker = os.path.join(marker_dir, f"fired-{point}")
        if os.path.exists(marker):
            return False
        open(marker, "w").close()
    return True


def test_hook(name: str) -> bool:
    """True when the test hook ``name`` is on (``MEGATRON_SPEC_TEST_HOOKS``, comma-separated names)."""
    return name in {x.strip() for x in os.environ.get("MEGATRON_SPEC_TEST_HOOKS", "").split(",")}


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def corrupt_weights(module, seed: int = 0) -> None:
    """Overwrite every floating parameter of ``module`` in place with Gaussian noise of the same
    root-mean-square (a fixed seed: the same garbage on every rank): a draft update gone wrong. The
    magnitudes stay those of a trained model (finite logits), but the function is random, so the
    draft proposes tokens unrelated to the target's and nearly every draft is rejected."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                rms = float(p.detach().float().pow(2).mean().sqrt())
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(rms or 1.0).to(p.dtype))
