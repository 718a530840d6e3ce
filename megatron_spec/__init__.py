"""megatron-spec: verifier-exact speculative decoding for GRPO rollouts on megatron-core.

Importing the package is cheap: it loads neither megatron-core nor the compiled
extension. Subpackages follow the data flow of one RL step (see docs/architecture.md).
"""

__version__ = "0.1.0"
