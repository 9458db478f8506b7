"""The class docstrings are runnable tutorials: run their code blocks, in order, in one
namespace, against real CPU sidecars, and compare what they print with their ``text`` blocks."""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import re
import textwrap

import pytest

from kalos_retrievers.langchain import KalosRetriever, KalosVectorStore

BLOCK = re.compile(r"```(python|text)\n(.*?)```", re.DOTALL)


def blocks(doc: str) -> tuple[list[str], str]:
    code, printed = [], []
    for kind, body in BLOCK.findall(doc):
        (code if kind == "python" else printed).append(textwrap.dedent(body))
    return code, "".join(printed)


@pytest.mark.parametrize("cls", [KalosVectorStore, KalosRetriever])
async def test_class_docstring_runs(cls: type) -> None:
    code, expected = blocks(inspect.getdoc(cls) or "")
    assert len(code) >= 6
    assert expected
    namespace: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for src in code:
            compiled = compile(src, f"<{cls.__name__} docstring>", "exec",
                               flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)  # fmt: skip
            result = eval(compiled, namespace)  # noqa: S307 - our own docstring
            if inspect.isawaitable(result):
                await result
    assert out.getvalue() == expected
    assert {"Setup:", "Instantiate:", "Add:", "Search:", "Retriever:", "Async:", "Timeouts:"} <= {
        line.strip() for line in (cls.__doc__ or "").splitlines()
    }
