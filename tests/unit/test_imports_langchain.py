"""Pin the public API of kalos_retrievers.langchain (as langchain-qdrant's test_imports does)."""

from __future__ import annotations

import kalos_retrievers.langchain as lc

EXPECTED_ALL = [
    "DEGRADED_EVENT",
    "KalosRetriever",
    "KalosTranslator",
    "KalosVectorStore",
    "KalosVectorStoreRetriever",
]


def test_all_imports() -> None:
    assert sorted(lc.__all__) == sorted(EXPECTED_ALL)
    for name in EXPECTED_ALL:
        assert getattr(lc, name) is not None


def test_public_classes_are_langchain_types() -> None:
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.vectorstores import VectorStore, VectorStoreRetriever

    assert issubclass(lc.KalosVectorStore, VectorStore)
    assert issubclass(lc.KalosRetriever, BaseRetriever)
    assert issubclass(lc.KalosVectorStoreRetriever, VectorStoreRetriever)
    assert lc.DEGRADED_EVENT == "kalos_degraded"
    from langchain_core.structured_query import Visitor

    assert issubclass(lc.KalosTranslator, Visitor)


def test_a_system_without_ofd_locks_is_told_kalos_needs_linux() -> None:
    """Where fcntl has no F_OFD_SETLK (macOS, the BSDs) importing Kalos raises an ImportError
    that says why, rather than an AttributeError at the first recall; on Linux it imports."""
    import subprocess
    import sys

    code = "import fcntl, kalos_retrievers.langchain as m; print('ok')"
    ok = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr  # (the control)
    gone = subprocess.run([sys.executable, "-P", "-c", "import fcntl; del fcntl.F_OFD_SETLK; " + code],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert gone.returncode != 0 and "ImportError: Kalos runs on Linux only" in gone.stderr, gone.stderr
