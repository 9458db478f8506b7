"""The optional C extensions (everything else is in pyproject.toml).

``kalos_retrievers._fastpath`` is the client's batch-1 recall in C: to a GPU sidecar's resident
kernel, or the request and the answer around the sidecar's wait (see
kalos_retrievers/_fastpath.c); ``kalos_retrievers.sidecar._hotpath`` is the
sidecar's batch-1 recall (taking the request, writing an arena answer; see
sidecar/_hotpath.c); ``kalos_retrievers.sidecar._launch`` is a GPU sidecar's launch of a batch
queued behind another (its descriptor and CUDA driver calls; see sidecar/_launch.c). All are
built against CPython's stable ABI (one binary for 3.11 and later) and are optional: where
they cannot be compiled (no C compiler), the package installs without them and the client and
the sidecar use their Python paths, which do the same.
"""

from setuptools import Extension, setup


def _ext(name: str, source: str) -> Extension:
    return Extension(
        name,
        [source],
        optional=True,
        py_limited_api=True,
        define_macros=[("Py_LIMITED_API", "0x030B0000")],
        extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
    )


setup(
    ext_modules=[
        _ext("kalos_retrievers._fastpath", "kalos_retrievers/_fastpath.c"),
        _ext("kalos_retrievers.sidecar._hotpath", "sidecar/_hotpath.c"),
        _ext("kalos_retrievers.sidecar._launch", "sidecar/_launch.c"),
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
