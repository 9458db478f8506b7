"""The built wheel: namespaced packages only, the CUDA sources included, the CLI declared."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_wheel_contains_kernels_and_nothing_bare(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                        str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = tmp_path.glob("kalos_retrievers-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"kalos_retrievers", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    for cu in (ROOT / "kernels").glob("*.cu"):
        assert f"kalos_retrievers/sidecar/kernels/{cu.name}" in names
    for py in (ROOT / "sidecar").glob("*.py"):
        assert f"kalos_retrievers/sidecar/{py.name}" in names
    for py in (ROOT / "kalos_retrievers").rglob("*.py"):  # every subpackage is listed in pyproject
        assert f"kalos_retrievers/{py.relative_to(ROOT / 'kalos_retrievers')}" in names, py
    assert "kalos_retrievers/py.typed" in names
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    entry = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "kalos-sidecar = kalos_retrievers.sidecar.cli:main" in entry
    # the license's text ships (Apache-2.0 asks for it), and the metadata names it
    assert f"{dist_info}/licenses/LICENSE" in names
    assert "Apache License" in zipfile.ZipFile(wheel).read(f"{dist_info}/licenses/LICENSE").decode()
    meta = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta
