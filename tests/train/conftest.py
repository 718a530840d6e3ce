"""The small real HF checkpoints of the model tests (made once per session)."""

from tests.models.conftest import hf_checkpoints  # noqa: F401 (a fixture, found by name)
