"""Shared pytest set-up: GPU tests skip cleanly without CUDA; a session-wide small target with a
ModelOpt-trained EAGLE-3 draft (``setup``) for the engine, sync and GRPO tests."""

from __future__ import annotations

import os

import pytest
import torch

from tests.model_factory import Setup, load_native, load_setup, make_setup  # noqa: F401 (load_native: tests import it from here)

os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def setup(tmp_path_factory) -> Setup:
    """The small target, a second one of the same shape, a draft model and the target's ModelOpt EAGLE-3
    draft.

    Made here once per session; ``MEGATRON_SPEC_TEST_MODELS=DIR`` reads them from a folder made before by
    ``python -m tests.model_factory DIR`` instead (the GPU check kit carries one to a machine without
    ModelOpt).
    """
    prepared = os.environ.get("MEGATRON_SPEC_TEST_MODELS")
    if prepared:
        return load_setup(prepared)
    return make_setup(tmp_path_factory.mktemp("rollout"))
