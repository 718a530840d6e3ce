"""The policy's training machinery, under the RL recipe and the SFT script alike: megatron-core DDP
(``ddp``), AdamW on fp32 main weights (``optimizer``), and what the trainer moves to host memory while a
colocated engine generates (``offload``, docs/memory_plan.md). The models themselves are in ``models``."""
