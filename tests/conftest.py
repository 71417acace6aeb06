"""Shared test set-up."""

import pytest

from diversed.tasks.sandbox import SandboxUnavailableError, isolation


@pytest.fixture(autouse=True, scope="session")
def _costs_kept_apart(tmp_path_factory):
    """Speed costs measured by the tests (the command line's, the server's) go to a cache folder of their own,
    never to the user's (subprocesses inherit it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIVERSED_COSTS", str(tmp_path_factory.mktemp("costs") / "speed-costs.json"))
        yield


@pytest.fixture
def sandbox():
    """Skip a test that runs code where bubblewrap does not work (rather than fail it, or run code unconfined)."""
    try:
        isolation()
    except SandboxUnavailableError as e:
        pytest.skip(f"needs the bubblewrap sandbox: {e}")
