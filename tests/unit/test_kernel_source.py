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


def test_a_source_of_other_layouts_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The host writes the structs the packaged source lays out (``struct BellSpaces``: its
    lists' lengths last since session 54): another source's kernels must read them there. The
    same structs with other comments and spacing pass; one field moved is refused, naming the
    struct (the file 642a088 had, run with today's host, would have read shifted addresses)."""
    ours = cuda_kernels.packaged_source()
    start = ours.index("struct BellSpaces {")
    body = ours[start : ours.index("};", start) + 2]
    same = tmp_path / "same.cu"
    same.write_text(body.replace("int rows[", "int   rows[").replace("{", "{  // a comment", 1) + "\n")
    assert "BellSpaces" in cuda_kernels._structs(same.read_text())  # (read, not passed over)
    monkeypatch.setenv("KALOS_KERNEL_SOURCE", str(same))
    assert cuda_kernels.source() == same.read_text()
    lines = body.splitlines()
    (rows,) = [i for i, line in enumerate(lines) if "int rows[" in line]
    moved = [lines[0], lines[rows], *(line for i, line in enumerate(lines[1:], 1) if i not in (rows, rows + 1))]
    other = tmp_path / "other.cu"
    other.write_text("\n".join(moved) + "\n")
    monkeypatch.setenv("KALOS_KERNEL_SOURCE", str(other))
    with pytest.raises(ValueError, match="BellSpaces"):
        cuda_kernels.source()
