"""Shared test setup: every test runs on the CPU; helpers switches the Triton interpreter on."""

import helpers  # noqa: F401  (on a CPU it switches the Triton interpreter on: helpers.env)
import pytest

from helpers.compare.methods import METHODS, Method


@pytest.fixture
def temporary_method():
    """Register a Method for one test and remove it afterwards."""
    added = []

    def add(method: Method) -> Method:
        METHODS[method.name] = method
        added.append(method.name)
        return method

    yield add
    for name in added:
        METHODS.pop(name, None)
