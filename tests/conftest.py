"""Shared test setup: every test runs on the CPU; helpers switches the Triton interpreter on."""

import helpers  # noqa: F401  (import first: it sets TRITON_INTERPRET=1 before triton is imported)
import pytest

from helpers.methods import METHODS, Method


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
