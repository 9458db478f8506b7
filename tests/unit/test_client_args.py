"""The client's argument checks that need no sidecar."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from kalos_retrievers.client import KalosClient

pytestmark = pytest.mark.timeout(30)


def test_an_upsert_of_no_rows_checks_its_arguments_without_a_sidecar() -> None:
    """Zero vectors send nothing (no sidecar needed: a lazy client stays unconnected), but the
    arguments are refused as for rows, as ``check_upsert`` says ``upsert`` would."""
    c = KalosClient(f"kalos-unit-zero-{uuid.uuid4().hex[:8]}", dim=3, lazy=True)
    none = np.empty((0, 3), np.float32)
    assert c.upsert([], none) == [] and c.upsert(None, none) == []
    for kwargs, err, match in [
        ({"ids": ["a"]}, ValueError, "ids has 1 entries but vectors has 0"),
        ({"ids": [], "texts": ["x"]}, ValueError, "texts has 1 entries but vectors has 0"),
        ({"ids": [], "metadatas": [{}]}, ValueError, "metadatas has 1 entries but vectors has 0"),
        ({"ids": [], "namespace": 5}, TypeError, "namespace must be a str"),
        ({"ids": [], "timeout": -1}, ValueError, "timeout=-1"),
    ]:
        with pytest.raises(err, match=match):
            c.upsert(vectors=none, **kwargs)
    assert not c.connected
