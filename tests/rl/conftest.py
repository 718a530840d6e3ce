"""The vLLM fixtures (the real model, its chat prompts, a ModelOpt EAGLE-3 draft for it) shared with
``tests/rollout/test_vllm_backend.py``, for the GRPO-with-vLLM tests here."""

from tests.rollout.test_vllm_backend import chat, smollm2, smollm2_eagle3  # noqa: F401 (fixtures, found by name)
