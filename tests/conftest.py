"""Shared test set-up."""

import pytest

import diversed.decoding.schedule as schedule


@pytest.fixture(autouse=True, scope="session")
def _costs_kept_apart(tmp_path_factory):
    """Speed costs measured by the tests go to a file of their own, never to the user's cache folder."""
    path = tmp_path_factory.mktemp("costs") / schedule.COSTS_FILE
    original = schedule._costs_path
    schedule._costs_path = lambda: path
    yield
    schedule._costs_path = original
