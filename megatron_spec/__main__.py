"""``python -m megatron_spec ...`` is the ``megatron-spec`` console script."""

from megatron_spec.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
