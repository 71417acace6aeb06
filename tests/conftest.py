"""Shared test set-up."""

import pytest

import diversed.decoding.schedule as schedule
from diversed.tasks.sandbox import SandboxUnavailableError, isolation


@pytest.fixture(autouse=True, scope="session")
def _costs_kept_apart(tmp_path_factory):
    """Speed costs measured by the tests go to a file of their own, never to the user's cache folder."""
    original = schedule.COSTS.path
    schedule.COSTS.path = tmp_path_factory.mktemp("costs") / schedule.COSTS_FILE
    yield
    schedule.COSTS.path = original


@pytest.fixture
def sandbox():
    """Skip a test that runs code where bubblewrap does not work (rather than fail it, or run code unconfined)."""
    try:
        isolation()
    except SandboxUnavailableError as e:
        pytest.skip(f"needs the bubblewrap sandbox: {e}")
