"""Subcommands of the ``megatron-spec`` console script (see ``megatron_spec.cli``)."""
