"""The ``megatron-spec`` console script: one subcommand per module in ``megatron_spec.commands``.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their command runs, so ``--help`` is
fast and a missing optional dependency only affects the command that needs it.
Only commands that work are listed here; nothing is registered ahead of its implementation.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# command name -> module; keep sorted.
COMMANDS: dict[str, str] = {
    "export-hf": "megatron_spec.commands.export_hf",
    "fetch-model": "megatron_spec.commands.fetch_model",
    "generate": "megatron_spec.commands.generate",
    "info": "megatron_spec.commands.info",
    "report": "megatron_spec.commands.report",
    "simulate": "megatron_spec.commands.simulate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-spec",
        description="Verifier-exact speculative decoding for GRPO rollouts on megatron-core.",
    )
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    from megatron_spec.exit import exit_now

    exit_now(main())  # without the interpreter's finalisation (megatron_spec/exit.py)
