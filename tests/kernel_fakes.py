"""Stand-ins for CuPy's kernels and device arrays, for tests that run a kernel's launch on the
CPU: each launch is checked against the kernel's parameter list read from kernels/recall.cu
(count, and pointer / integer / 64-bit / float kinds), so that a kernel whose parameters change
without its launch fails CI, which has no GPU. What they cannot check is what the kernels
compute: the GPU tests do."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import numpy as np
from kalos_retrievers.sidecar import cuda_kernels

SOURCE = cuda_kernels.packaged_source()


def kernel_params(name: str) -> list[str]:
    """The parameter kinds of ``__global__ ... name(...)`` in recall.cu: "ptr", "i32", "u64",
    "f32" (template parameters aside)."""
    m = re.search(rf"(?:__global__[^;{{]*?\b|^){name}\((.*?)\)\s*{{", SOURCE, re.S | re.M)
    assert m is not None, f"kernel {name} not found in recall.cu"
    kinds = []
    for raw in m.group(1).split(","):
        p = " ".join(raw.split())
        if "*" in p:
            kinds.append("ptr")
        elif re.match(r"(const )?int\b", p):
            kinds.append("i32")
        elif re.match(r"(const )?(u64|unsigned long long)\b", p):
            kinds.append("u64")
        elif re.match(r"(const )?float\b", p):
            kinds.append("f32")
        else:
            raise AssertionError(f"{name}: cannot read the parameter {p!r}")
    return kinds


class DevArray(np.ndarray):
    """Device memory stood in for by host memory: ``.data.ptr`` is the address."""

    @property
    def data(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(ptr=self.ctypes.data)


def dev(a: np.ndarray) -> DevArray:
    return np.ascontiguousarray(a).view(DevArray)


class FakeKernel:
    """A kernel launch checked against recall.cu's parameter list, then recorded."""

    def __init__(self, name: str, log: list[tuple[str, tuple]]) -> None:
        self.name, self.log = name, log
        self.kinds = kernel_params(name)
        self.max_dynamic_shared_size_bytes = 48 * 1024
        self.num_regs = 64

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        assert len(args) == len(self.kinds), (self.name, len(args), len(self.kinds))
        for i, (a, kind) in enumerate(zip(args, self.kinds, strict=True)):
            ok = {"ptr": isinstance(a, (DevArray, np.uint64)), "i32": isinstance(a, np.int32),
                  "u64": isinstance(a, np.uint64), "f32": isinstance(a, np.float32)}[kind]  # fmt: skip
            assert ok, f"{self.name} argument {i}: {type(a).__name__} for a {kind} parameter"
        assert shared_mem <= max(48 * 1024, self.max_dynamic_shared_size_bytes), (self.name, shared_mem)
        assert all(isinstance(x, int) and x > 0 for x in grid + block), (self.name, grid, block)
        self.log.append((self.name, args))


class NullStream:
    """A CuPy device or stream stood in for: a context that does nothing, a synchronize that
    returns at once, and a graph capture that returns a token."""

    def __enter__(self) -> NullStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def begin_capture(self) -> None:
        return None

    def end_capture(self) -> object:
        return object()
