"""megatron-spec: verifier-exact speculative decoding for GRPO rollouts on megatron-core.

Importing the package is cheap: it loads neither megatron-core nor the compiled
extension. Subpackages follow the data flow of one RL step (see docs/architecture.md).
"""

__version__ = "0.1.0"


def _apply_no_native_bf16_switch() -> None:
    """``MEGATRON_SPEC_NO_NATIVE_BF16=1`` runs this machine as an AVX2 CPU without native bf16.

    Besides making ``megatron_spec.isa.probe`` report no native bf16, it caps oneDNN
    (``ONEDNN_MAX_CPU_ISA``) and torch's own kernels (``ATEN_CPU_CAPABILITY``) at AVX2, so code that
    bypassed the dtype choice fails here as it would on such a CPU. Both are read by torch on first
    use, so this works when the package is imported before any matmul; child processes (the engine,
    torchrun's ranks) inherit them. It also gives inductor a cache directory of its own
    (``TORCHINDUCTOR_CACHE_DIR``): compiled graphs are not shared between the two modes. Variables the
    user set explicitly are kept.
    """
    import os

    if os.environ.get("MEGATRON_SPEC_NO_NATIVE_BF16", "0").strip().lower() in ("1", "true", "yes", "on"):
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        # Inductor's on-disk cache does not tell the two modes apart: a graph compiled with native
        # bf16 and reused under the switch gave NaN logits, one compiled under the switch and reused
        # natively aborted the process. The switched mode keeps its own cache beside the default one.
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            import getpass
            import tempfile

            try:
                user = getpass.getuser()
            except (KeyError, OSError):
                user = "unknown"
            user = "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
                tempfile.gettempdir(), f"torchinductor_{user}_no_native_bf16"
            )


_apply_no_native_bf16_switch()
