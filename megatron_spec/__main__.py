"""``python -m megatron_spec ...`` is the ``megatron-spec`` console script."""

from megatron_spec.cli import main

if __name__ == "__main__":
    from megatron_spec.exit import exit_now

    exit_now(main())  # without the interpreter's finalisation (megatron_spec/exit.py)
