"""The optional C extension (everything else is in pyproject.toml).

``kalos_retrievers._fastpath`` is the client's batch-1 recall to a GPU sidecar's resident
kernel in C (see kalos_retrievers/_fastpath.c). It is built against CPython's stable ABI (one
binary for 3.11 and later) and is optional: where it cannot be compiled (no C compiler), the
package installs without it and the client uses its Python path, which does the same.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kalos_retrievers._fastpath",
            ["kalos_retrievers/_fastpath.c"],
            optional=True,
            py_limited_api=True,
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
