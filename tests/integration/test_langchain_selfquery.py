"""``KalosTranslator``: LangChain's structured queries (what ``SelfQueryRetriever``'s LLM
writes) as Kalos filters. Each comparison and operation is translated, run on a real sidecar
(odd dim 29) and checked against a Python reading of what the LangChain query means; a
``like`` with no exact Kalos form is refused, never read as something else."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

import pytest
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.structured_query import Comparator, Comparison, Operation, Operator, StructuredQuery

from kalos_retrievers import Sidecar
from kalos_retrievers.filters import validate_filter
from kalos_retrievers.langchain import KalosTranslator, KalosVectorStore
from kalos_retrievers.langchain.query_constructor import _starting_with

ROWS: list[dict[str, Any]] = [
    {"genre": "scifi", "year": 1999, "rating": 8.5, "tags": ["space", "ai"], "title": "The Matrix",
     "released": "1999-03-31", "kids": False},
    {"genre": "scifi", "year": 2014, "rating": 8.6, "tags": ["space"], "title": "Interstellar",
     "released": "2014-11-07", "kids": False},
    {"genre": "drama", "year": 1994, "rating": 9.3, "tags": ["prison"], "title": "The Shawshank Redemption",
     "released": "1994-09-23", "kids": False},
    {"genre": "animated", "year": 2001, "rating": 8.6, "tags": ["spirits", "ai"], "title": "Spirited Away",
     "released": "2001-07-20", "kids": True},
    {"genre": "thriller", "year": 2010, "rating": 8.8, "title": "Inception", "kids": False},
    {"genre": "animated", "year": 1995, "tags": [], "title": "Toy Story", "released": "1995-11-22", "kids": True},
    {"genre": "drama", "year": 2019.0, "rating": 8.5, "tags": ["class"], "title": "Parasite", "released": "2019-05-30"},
    {"genre": "Scifi", "year": 1982, "rating": 8.1, "tags": ["ai", "replicant"], "title": "Blade Runner",
     "released": "1982-06-25", "kids": False},
    {"genre": "documentary", "title": "Ünïcode Über Äpfel", "tags": ["über"], "year": None},
    {"genre": "scifi", "year": 1968, "rating": 8.3, "title": "2001: A Space Odyssey", "tags": "space",
     "released": "1968-04-02"},
    {"title": "The Thing", "year": 1982},
    {"title": "\ufffdx", "genre": "odd"}, {"title": "\U0001f600y", "genre": "odd"},
    {"title": "\U0001f600", "genre": "odd"}, {"title": "\U0001f601", "genre": "odd"},
    {"title": "\ud7ffz", "genre": "odd"}, {"title": "\ue000", "genre": "odd"},
    {"title": "\U0010ffff\U0010ffffa", "genre": "odd"}, {"title": "\U0010ffffb", "genre": "odd"},
    {"genre": "scifi-horror", "year": 1979, "rating": 8.5, "title": "Alien", "tags": ["space", "horror"]},
]  # fmt: skip
IDS = [f"m{i}" for i in range(len(ROWS))]
_MISSING = object()
C, OP = Comparator, Operator


def cmp(c: C, field: str, value: Any) -> Comparison:
    return Comparison(comparator=c, attribute=field, value=value)


def op(o: Operator, *args: Any) -> Operation:
    return Operation(operator=o, arguments=list(args))


CASES = [
    cmp(C.EQ, "genre", "scifi"), cmp(C.EQ, "kids", True), cmp(C.EQ, "year", 2019), cmp(C.EQ, "year", None),
    cmp(C.NE, "genre", "scifi"), cmp(C.NE, "kids", True),
    cmp(C.GT, "year", 2000), cmp(C.GTE, "rating", 8.6), cmp(C.LT, "year", 1990.5), cmp(C.LTE, "rating", 8.5),
    cmp(C.GT, "title", "S"), cmp(C.LT, "title", "Inception"),
    cmp(C.GTE, "released", {"date": "2001-07-20", "type": "date"}),
    cmp(C.LT, "released", {"datetime": "1995-01-01T00:00:00", "type": "datetime"}),
    cmp(C.IN, "genre", ["drama", "thriller"]), cmp(C.NIN, "genre", ["drama", "thriller", "scifi"]),
    cmp(C.IN, "year", [1982, 2014.0]), cmp(C.IN, "genre", "drama"),
    cmp(C.CONTAIN, "tags", "ai"), cmp(C.CONTAIN, "tags", "space"), cmp(C.CONTAIN, "title", "The"),
    cmp(C.CONTAIN, "title", "über"), cmp(C.CONTAIN, "tags", "über"), cmp(C.CONTAIN, "year", 1982),
    cmp(C.LIKE, "title", "%Space%"), cmp(C.LIKE, "title", "Space"), cmp(C.LIKE, "title", "The%"),
    cmp(C.LIKE, "genre", "scifi%"), cmp(C.LIKE, "title", "Ün%"), cmp(C.LIKE, "title", "%in%"),
    cmp(C.LIKE, "title", "\U0001f600%"), cmp(C.LIKE, "title", "\ufffd%"), cmp(C.LIKE, "title", "\ud7ff%"),
    cmp(C.LIKE, "title", "\U0010ffff%"), cmp(C.LIKE, "title", "\U0010ffff\U0010ffff%"),
    cmp(C.GT, "title", "\ufffe"), cmp(C.LT, "title", "\U0001f600z"),
    op(OP.AND, cmp(C.EQ, "genre", "scifi"), cmp(C.GT, "year", 1990)),
    op(OP.OR, cmp(C.EQ, "genre", "drama"), cmp(C.CONTAIN, "tags", "ai")),
    op(OP.NOT, cmp(C.EQ, "genre", "scifi")),
    op(OP.NOT, cmp(C.EQ, "genre", "scifi"), cmp(C.EQ, "genre", "drama")),
    op(OP.AND, op(OP.NOT, cmp(C.LT, "year", 2000)),
       op(OP.OR, cmp(C.GTE, "rating", 8.6), cmp(C.LIKE, "title", "%Parasite%"))),
    op(OP.AND, cmp(C.EQ, "genre", "scifi")),
]  # fmt: skip


def _like_re(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + "".join(".*" if ch == "%" else "." if ch == "_" else re.escape(ch) for ch in pattern)
                      + "$", re.S)  # fmt: skip


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _equal(a: Any, b: Any) -> bool:
    return (type(a) is bool) == (type(b) is bool) and a == b


def _holds(node: Any, m: dict[str, Any]) -> bool:
    """What the LangChain query means for metadata ``m`` (SQL LIKE; a pattern without ``%`` a
    substring), with Kalos's rules: ne/nin match a missing field, types never mix."""
    if isinstance(node, Operation):
        vals = [_holds(a, m) for a in node.arguments]
        return {OP.AND: all(vals), OP.OR: any(vals), OP.NOT: not any(vals)}[node.operator]
    c, v, x = node.comparator, node.value, m.get(node.attribute, _MISSING)
    if isinstance(v, dict):
        v = v[v["type"]]
    if c in (C.IN, C.NIN) and not isinstance(v, list):
        v = [v]
    if c == C.EQ:
        return x is not _MISSING and _equal(x, v)
    if c == C.NE:
        return not (x is not _MISSING and _equal(x, v))
    if c in (C.GT, C.GTE, C.LT, C.LTE):
        if not ((_number(x) and _number(v)) or (isinstance(x, str) and isinstance(v, str))):
            return False
        return {C.GT: x > v, C.GTE: x >= v, C.LT: x < v, C.LTE: x <= v}[c]
    if c == C.IN:
        return x is not _MISSING and any(_equal(x, a) for a in v)
    if c == C.NIN:
        return not (x is not _MISSING and any(_equal(x, a) for a in v))
    if c == C.CONTAIN:
        return (isinstance(x, list) and any(_equal(y, v) for y in x)) or (
            isinstance(x, str) and isinstance(v, str) and v in x)  # fmt: skip
    assert c == C.LIKE
    return isinstance(x, str) and bool(_like_re(v if "%" in v else f"%{v}%").match(x))


def test_every_comparison_and_operation_finds_what_the_query_means(
    start_sidecar: Callable[..., Sidecar],
) -> None:
    sc = start_sidecar(dim=29)
    store = KalosVectorStore(DeterministicFakeEmbedding(size=29), name=sc.name)
    store.add_texts([r["title"] for r in ROWS], metadatas=ROWS, ids=IDS)
    translator = KalosTranslator()
    for node in CASES:
        query, kwargs = translator.visit_structured_query(StructuredQuery(query="movie", filter=node))
        assert query == "movie"
        got = sorted(d.id or "" for d in store.similarity_search(query, k=len(ROWS), **kwargs))
        want = sorted(i for i, m in zip(IDS, ROWS, strict=True) if _holds(node, m))
        assert got == want, (node, kwargs)
    assert translator.visit_structured_query(StructuredQuery(query="m", filter=None, limit=2)) == ("m", {})
    store.close()


def test_like_patterns_without_an_exact_form_are_refused() -> None:
    t = KalosTranslator()
    for pattern in ["%Away", "T_e%", "%a%b%", "%", "", "a%b"]:
        with pytest.raises(ValueError, match="has no exact form"):
            t.visit_structured_query(StructuredQuery(query="m", filter=cmp(C.LIKE, "title", pattern)))
    with pytest.raises(ValueError, match="takes one value, not a list; use in or nin"):
        t.visit_comparison(cmp(C.EQ, "tags", ["ai"]))
    with pytest.raises(ValueError, match="needs a string pattern"):
        t.visit_comparison(cmp(C.LIKE, "year", 1999))
    with pytest.raises(ValueError, match=r"filter\['year'\]"):  # (checked as a search checks it)
        t.visit_structured_query(StructuredQuery(query="m", filter=cmp(C.GT, "year", float("nan"))))
    assert t.visit_comparison(cmp(C.LIKE, "title", "The%")) == {"title": {"$gte": "The", "$lt": "Thf"}}
    assert t.visit_operation(op(OP.NOT, cmp(C.EQ, "a", 1), cmp(C.EQ, "b", 2))) == {
        "$not": {"$or": [{"a": {"$eq": 1}}, {"b": {"$eq": 2}}]}}  # fmt: skip


def test_a_prefix_range_holds_exactly_the_strings_starting_with_it() -> None:
    """Against ``str.startswith`` over random strings near the edges of the code space
    (surrogates skipped, U+10FFFF), with the range compared as Kalos compares strings."""
    rnd = random.Random(11)
    alphabet = ["a", "b", "\ud7ff", "\ue000", "\uffff", "\U00010000", "\U0010fffe", "\U0010ffff"]
    for _ in range(3000):
        prefix = "".join(rnd.choices(alphabet, k=rnd.randint(1, 3)))
        cond = _starting_with("t", prefix)["t"]
        assert validate_filter({"t": cond})
        for _ in range(20):
            s = "".join(rnd.choices(alphabet, k=rnd.randint(0, 5)))
            if rnd.random() < 0.5:
                s = prefix + s
            inside = s >= cond["$gte"] and ("$lt" not in cond or s < cond["$lt"])
            assert inside == s.startswith(prefix), (prefix, s, cond)


def test_the_docstring_example_runs() -> None:
    import doctest

    from kalos_retrievers.langchain import query_constructor

    assert doctest.testmod(query_constructor).attempted >= 2 and not doctest.testmod(query_constructor).failed
