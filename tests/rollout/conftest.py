"""Engine tests use the session fixtures of tests/conftest.py (``setup``, ``load_native``)."""

from tests.conftest import Setup, load_native  # noqa: F401  (re-exported for the tests)
