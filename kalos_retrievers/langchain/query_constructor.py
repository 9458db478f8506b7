"""``KalosTranslator``: LangChain's structured queries as Kalos filters, for self-querying.

LangChain's ``SelfQueryRetriever`` has an LLM write a ``StructuredQuery`` (a search string and
a filter in LangChain's own small language) and hands it to a *translator* for the store's
filter dialect; it knows the translators of the stores LangChain ships, not this one. Pass it::

    from langchain_classic.retrievers.self_query.base import SelfQueryRetriever
    from kalos_retrievers.langchain import KalosTranslator

    retriever = SelfQueryRetriever.from_llm(
        llm, store, "Brief summary of a movie", metadata_field_info,
        structured_query_translator=KalosTranslator(),
    )

What each comparison becomes (``kalos_retrievers.filters`` is the dialect):

==============================  ==================================================================
LangChain                       Kalos
==============================  ==================================================================
``eq ne gt gte lt lte``         ``$eq $ne $gt $gte $lt $lte`` (one value; a list is refused: use in)
``in nin``                      ``$in $nin`` (one value is taken as a list of one)
``contain``                     a list holding the value (``$contains``), or, for a string, a
                                string holding it as a substring (``$like``)
``like "x"``, ``like "%x%"``    the string holds ``x`` (``$like``: a substring)
``like "x%"``                   the string starts with ``x``: ``$gte x`` and ``$lt`` the next
                                string of that length (Kalos orders strings by code point)
``and or``                      ``$and $or``
``not``                         ``$not`` (of several arguments: none of them matches)
==============================  ==================================================================

A date or datetime value (the query constructor writes ``{"date": "2024-01-31", "type":
"date"}``) becomes its ISO string, which compares in time order with the ISO strings a
``datetime`` or ``date`` in metadata is stored as (as strings: ``lte`` a date leaves out
datetimes later that day). A ``like`` pattern Kalos cannot express
exactly (a suffix ``"%x"``, a ``_``, a ``%`` inside) is refused with ``ValueError`` rather than
read as something else. As everywhere in Kalos, ``ne`` and ``nin`` also match rows without the
field, and values of different types never compare (``"2000"`` is not ``2000``).
"""

from __future__ import annotations

from typing import Any, Final

from langchain_core.structured_query import (
    Comparator,
    Comparison,
    Operation,
    Operator,
    StructuredQuery,
    Visitor,
)

from ..filters import validate_filter

_PLAIN: Final = {
    Comparator.EQ: "$eq", Comparator.NE: "$ne", Comparator.GT: "$gt", Comparator.GTE: "$gte",
    Comparator.LT: "$lt", Comparator.LTE: "$lte", Comparator.IN: "$in", Comparator.NIN: "$nin",
}  # fmt: skip


class KalosTranslator(Visitor):
    """Translate LangChain's structured query language into Kalos filter dicts.

    ``visit_structured_query`` returns ``(query, {"filter": ...})`` (``{}`` without a filter),
    the keyword arguments ``SelfQueryRetriever`` passes to the store's search; the filter is
    checked as a search would check it, so a bad one fails here, naming its path. The
    retriever takes a query's ``limit`` itself.

    >>> from langchain_core.structured_query import Comparator, Comparison, StructuredQuery
    >>> KalosTranslator().visit_structured_query(StructuredQuery(
    ...     query="space", filter=Comparison(comparator=Comparator.GT, attribute="year", value=1990)))
    ('space', {'filter': {'year': {'$gt': 1990}}})
    """

    allowed_comparators = tuple(Comparator)
    allowed_operators = (Operator.AND, Operator.OR, Operator.NOT)

    def visit_operation(self, operation: Operation) -> dict[str, Any]:
        self._validate_func(operation.operator)
        args = [a.accept(self) for a in operation.arguments]
        if operation.operator == Operator.NOT:
            return {"$not": args[0] if len(args) == 1 else {"$or": args}}
        if len(args) == 1:
            return args[0]
        return {f"${operation.operator.value}": args}

    def visit_comparison(self, comparison: Comparison) -> dict[str, Any]:
        self._validate_func(comparison.comparator)
        op, field, value = comparison.comparator, comparison.attribute, _value(comparison.value)
        if op in (Comparator.IN, Comparator.NIN):
            return {field: {_PLAIN[op]: value if isinstance(value, list) else [value]}}
        if op in _PLAIN:
            if isinstance(value, list):
                raise ValueError(f"{op.value}({field!r}, {value!r}) takes one value, not a list; use in or nin")
            return {field: {_PLAIN[op]: value}}
        if op == Comparator.CONTAIN:
            if isinstance(value, str):
                return {"$or": [{field: {"$contains": value}}, {field: {"$like": value}}]}
            return {field: {"$contains": value}}
        if op == Comparator.LIKE:
            if not isinstance(value, str):
                raise ValueError(f"like({field!r}, {value!r}) needs a string pattern")
            return _like(field, value)
        raise ValueError(f"KalosTranslator has no form for the comparator {op.value!r}")  # (a new one)

    def visit_structured_query(self, structured_query: StructuredQuery) -> tuple[str, dict[str, Any]]:
        if structured_query.filter is None:
            return structured_query.query, {}
        flt = structured_query.filter.accept(self)
        validate_filter(flt)
        return structured_query.query, {"filter": flt}


def _value(v: Any) -> Any:
    """The query constructor's ``{"date": "2024-01-31", "type": "date"}`` (or ``datetime``)
    as its ISO string; lists item by item; anything else as it is."""
    if isinstance(v, dict) and v.get("type") in ("date", "datetime") and v["type"] in v:
        return v[v["type"]]
    if isinstance(v, list | tuple):
        return [_value(x) for x in v]
    return v


def _like(field: str, pattern: str) -> dict[str, Any]:
    """A SQL ``LIKE`` pattern as the Kalos condition that matches exactly the same strings, or
    ``ValueError``. A pattern without ``%`` is read as a substring (what an LLM means by
    "like", and ``$like``); ``x%`` is the code-point range ``[x, x')`` where ``x'`` is ``x``
    with its last character the next one (every string starting with ``x`` is in it, and
    no other)."""
    lead = pattern.startswith("%")
    trail = len(pattern) > 1 and pattern.endswith("%")
    core = pattern[int(lead) : len(pattern) - int(trail)]
    if not core or "%" in core or "_" in core or (lead and not trail):
        raise ValueError(
            f"like({field!r}, {pattern!r}): Kalos matches a substring ('x' or '%x%') or a prefix "
            "('x%'); a suffix, '_' or an inner '%' has no exact form"
        )
    if lead or not trail:
        return {field: {"$like": core}}
    return _starting_with(field, core)


def _starting_with(field: str, prefix: str) -> dict[str, Any]:
    """The strings starting with ``prefix``: from it up to (not including) the prefix cut
    before its trailing U+10FFFFs (no character follows that one) with its last character
    the next one (skipping surrogates, which stored strings cannot hold)."""
    head = prefix.rstrip("\U0010ffff")
    if not head:
        return {field: {"$gte": prefix}}
    after = ord(head[-1]) + 1
    if 0xD800 <= after <= 0xDFFF:
        after = 0xE000
    return {field: {"$gte": prefix, "$lt": head[:-1] + chr(after)}}
