"""Fixtures: each kustomization (base and overlays), rendered once per session."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_manifests import kustomizations, rendered


@pytest.fixture(params=list(kustomizations()))
def kustomization(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def objects(kustomization: str) -> tuple[Any, ...]:
    """The rendered objects of one kustomization, empty documents dropped."""
    return tuple(doc for doc in rendered(kustomization) if doc)
