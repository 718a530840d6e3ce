"""GRPO with verifier-exact speculative rollouts on megatron-core.

RL post-training of a pretrained policy, not pre-training: the name follows Megatron-LM's entry scripts
(``pretrain_gpt.py``), as the design names this one, so the scripts that launch it keep working.

    torchrun --nproc_per_node N launch/pretrain_grpo_spec.py \\
        --hf-checkpoint DIR --prompt-data synthetic:sum --reward synthetic \\
        --tensor-model-parallel-size T --rollout-backend native \\
        --spec-draft-kind eagle3 --spec-draft-path DRAFT_DIR --spec-num-draft-tokens 3 \\
        --train-iters 20 --save RUN_DIR [--config run.yaml]

Flags come from the dataclasses in megatron_spec/config.py (``--help`` lists them all);
``--config FILE.yaml`` holds them for long runs. The resolved configuration is printed once
and saved as RUN_DIR/config.yaml. One JSON line of metrics per step goes to
RUN_DIR/metrics.jsonl (docs/metrics.md); ``megatron-spec report RUN_DIR`` plots them.

A user error (a bad flag value, a missing ``--config`` file or ``--hf-checkpoint`` directory, a draft
for another model: ``megatron_spec.config.ConfigError``) is found before ``torch.distributed``
starts and printed as one ``error:`` line by rank 0; every rank exits 2. A crash keeps its traceback.
torchrun itself still prints its ChildFailedError report under that line when a worker exits 2; on
one machine ``python launch/pretrain_grpo_spec.py --nproc-per-node N ...`` checks the flags once
and then starts the N workers itself (torchrun ``--standalone``), so a user error is the one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_spec.config import ConfigError, add_arguments, from_args

PROG = "pretrain_grpo_spec.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="without torchrun: check the flags, then start this many workers on this machine "
        "(torchrun --standalone); ignored under torchrun",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    spawn = args.nproc_per_node if "LOCAL_RANK" not in os.environ else None
    if spawn is not None and spawn < 1:
        print(f"{PROG}: error: --nproc-per-node {spawn} must be >= 1", file=sys.stderr)
        return 2
    from megatron_spec.compat.fallbacks import fallback_line, quiet_fallback_warnings

    # every rank: megatron-core's per-module fallback warnings; rank 0 says them once
    quiet_fallback_warnings()
    rank = int(os.environ.get("RANK", "0"))
    world_size = spawn or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        from megatron_spec.rl.preflight import check_inputs, openmp_wait_policy

        cfg = from_args(args)
        policy = openmp_wait_policy(cfg, os.environ)
        if policy:  # before torch loads OpenMP (check_inputs may import it); workers and engines inherit it
            os.environ["OMP_WAIT_POLICY"] = policy
        check_inputs(cfg, world_size)
    except ConfigError as exc:
        # Every rank of a machine finds the same error (no process group yet): one line, from its
        # local rank 0. The others wait a moment, so that torchrun, which stops all workers when the
        # first one exits, does not stop the one that prints before it has printed.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        else:
            time.sleep(5)
        return 2
    if spawn:
        return _spawn_workers(spawn, argv)
    if rank == 0 and cfg.checkpoint.save:
        from megatron_spec.rl.checkpoint import hold_run_folder

        try:
            _run_lock = hold_run_folder(cfg.checkpoint.save)  # held open until this process ends
        except ConfigError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
            return 2
    from megatron_spec.telemetry import configure_logging

    configure_logging(rank)
    if rank == 0:
        print("resolved configuration:\n" + cfg.to_yaml(), file=sys.stderr, flush=True)
        print(fallback_line(), file=sys.stderr, flush=True)
        if policy:
            print(f"OMP_WAIT_POLICY={policy}: generation overlaps training on the same cores "
                  "(docs/benchmark_log.md, \"OpenMP's wait policy\")", file=sys.stderr, flush=True)

    from megatron_spec.parallel import destroy_parallel
    from megatron_spec.rl.trainer import GRPOTrainer
    from megatron_spec.telemetry import start_end_means

    try:
        trainer = GRPOTrainer(cfg)
        history = trainer.run()
    except ConfigError as exc:  # found by a rank after start-up (one line per rank that found it)
        where = f" (rank {rank})" if world_size > 1 else ""
        print(f"{PROG}: error{where}: {exc}", file=sys.stderr, flush=True)
        return 2
    if rank == 0 and history:
        reward_start, reward_end, w = start_end_means(history, "reward/mean")
        summary = {
            "steps": len(history), "run_dir": trainer.run_dir,
            "reward_start": reward_start, "reward_end": reward_end, "reward_window_steps": w,
            "prompts_per_step": cfg.grpo.prompts_per_step, "group_size": cfg.grpo.grpo_group_size,
            "eval_reward_start": history[0].get("eval/reward"),
            "eval_reward_end": history[-1].get("eval_final/reward"),
            "accept_length_mean": sum(h["spec/accept_length"] for h in history) / len(history),
            "gen_s_mean": sum(h["time/gen"] for h in history) / len(history),
            "step_s_mean": sum(h["time/step"] for h in history) / len(history),
        }
        print(json.dumps(summary), flush=True)
    destroy_parallel()
    return 0


def _spawn_workers(nproc: int, argv: list[str]) -> int:
    """``nproc`` workers of this script on this machine, through torchrun's own launcher. A worker
    that exits 2 has printed its ``error:`` line: exit 2 without torchrun's failure report (a worker
    that crashed gets the report and its traceback, as under torchrun)."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's lines about a worker that exited 2 (it printed why) and the others it then stops
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: not record.getMessage().startswith(("failed (exitcode: 2)", "Sending process")))
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", os.path.abspath(__file__), *argv]))
    except ChildFailedError as exc:
        if exc.get_first_failure()[1].exitcode == 2:
            return 2
        raise
    return 0


if __name__ == "__main__":
    from megatron_spec.exit import exit_now

    exit_now(main())  # without the interpreter's finalisation (megatron_spec/exit.py)
