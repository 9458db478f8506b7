"""Which CUDA source the GPU backend compiles: the packaged one, or ``KALOS_KERNEL_SOURCE``'s."""

from __future__ import annotations

import pytest
from kalos_retrievers.sidecar import cuda_kernels


def test_the_packaged_source_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KALOS_KERNEL_SOURCE", raising=False)
    text = cuda_kernels.source()
    assert text == cuda_kernels.packaged_source()
    assert "doorbell_topk" in text


def test_another_version_for_an_a_b(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    other = tmp_path / "recall_old.cu"
    other.write_text("// an older recall.cu\n")
    monkeypatch.setenv("KALOS_KERNEL_SOURCE", str(other))
    assert cuda_kernels.source() == "// an older recall.cu\n"
    monkeypatch.setenv("KALOS_KERNEL_SOURCE", "")  # empty: as if unset
    assert cuda_kernels.source() == cuda_kernels.packaged_source()


def test_a_missing_file_says_which(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KALOS_KERNEL_SOURCE", str(tmp_path / "nope.cu"))
    with pytest.raises(FileNotFoundError, match=r"KALOS_KERNEL_SOURCE=.*nope\.cu"):
        cuda_kernels.source()
