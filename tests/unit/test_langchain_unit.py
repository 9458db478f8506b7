"""LangChain adapter pieces that need no sidecar: argument checks, Document<->row mapping,
construction without a running sidecar, the degradation event payload."""

from __future__ import annotations

import logging
import uuid

import pytest
from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from pydantic import ValidationError

from kalos_retrievers import Degrader, Hit, KalosClient, Record, SidecarTimeout
from kalos_retrievers.langchain import KalosRetriever, KalosVectorStore
from kalos_retrievers.langchain._convert import as_matrix, to_document, to_rows
from kalos_retrievers.langchain._degraded import _event_data

EMB = DeterministicFakeEmbedding(size=3)


def absent_name() -> str:
    return f"lcunit{uuid.uuid4().hex[:10]}"


# ------------------------------------------------------------------ mapping


def test_to_document_keeps_metadata_unchanged() -> None:
    meta = {"a": 1, "nested": {"b": [1, 2]}}
    hit = Hit("id-1", 0.5, "text", meta)
    assert to_document(hit) == Document("text", metadata={"a": 1, "nested": {"b": [1, 2]}},
                                        id="id-1")  # fmt: skip
    rec = Record("id-2", "", {}, "ns")
    assert to_document(rec) == Document("", metadata={}, id="id-2")


def test_documents_built_without_validation_equal_validated_ones() -> None:
    # to_document skips pydantic's validation (the values are known to be str/dict/str);
    # the result must be indistinguishable from Document(...).
    import copy
    import pickle

    from langchain_core.load import dumpd

    from kalos_retrievers.langchain import _convert

    assert _convert._FAST  # this langchain-core/pydantic: the fast path is in use
    meta = {"a": 1, "nested": {"b": [1, 2]}, "none": None}
    fast = to_document(Hit("id-1", 0.5, "text", meta))
    want = Document("text", metadata={"a": 1, "nested": {"b": [1, 2]}, "none": None}, id="id-1")
    assert type(fast) is Document
    assert fast == want
    assert fast.metadata == meta
    assert fast.id == "id-1"
    assert fast.page_content == "text"
    assert fast.model_fields_set == want.model_fields_set
    assert fast.model_dump() == want.model_dump()
    assert repr(fast) == repr(want)
    assert dumpd(fast) == dumpd(want)
    assert pickle.loads(pickle.dumps(fast)) == want  # noqa: S301 (our own bytes)
    assert copy.deepcopy(fast) == want
    assert fast.model_copy(update={"page_content": "x"}).page_content == "x"
    fast.metadata["added"] = True  # a normal, mutable Document
    fast.id = "id-2"
    assert fast.id == "id-2"
    assert "added" in fast.metadata


def test_to_document_falls_back_to_validation_for_other_types() -> None:
    from kalos_retrievers.langchain._convert import make_document

    doc = make_document("t", {"a": 1}, 7)  # type: ignore[arg-type]
    assert doc.id == "7"  # Document's own coercion
    with pytest.raises(ValidationError):
        make_document("t", [1, 2], "x")  # type: ignore[arg-type]


def test_recall_result_id_text_metadata() -> None:
    import numpy as np

    from kalos_retrievers.protocol import encode_doc
    from kalos_retrievers.results import RecallResult

    views = [memoryview(encode_doc(f"id-{i}", f"text {i}", b'{"i": %d}' % i if i else b"",
                                   1.0, 2.0)) for i in range(3)]  # fmt: skip
    res = RecallResult(np.arange(3, dtype=np.int32), np.array([0.9, 0.5, 0.1], np.float32),
                       views)  # fmt: skip
    first = res.id_text_metadata()
    assert first == [("id-0", "text 0", {}), ("id-1", "text 1", {"i": 1}),
                     ("id-2", "text 2", {"i": 2})]  # fmt: skip
    assert res.id_text_metadata()[1][2] is not first[1][2]  # freshly decoded every time
    assert res.id_text_metadata([2, 0]) == [first[2], first[0]]
    hit = res[1]  # read as a Hit: its values are given
    assert res.id_text_metadata([1])[0][2] is hit.metadata
    assert [(h.id, h.text, h.metadata) for h in res] == first
    assert RecallResult(np.zeros(0, np.int32), np.zeros(0, np.float32), []).id_text_metadata() == []
    with pytest.raises(ValueError, match="docs=False"):
        RecallResult(np.arange(1, dtype=np.int32), np.ones(1, np.float32), None).id_text_metadata()


def test_to_rows_fills_missing_ids_only() -> None:
    rows = to_rows(["a", "b", "c"], None, ["x", None, "z"])
    assert rows.ids[0] == "x"
    assert rows.ids[2] == "z"
    assert isinstance(rows.ids[1], str)
    assert len(rows.ids[1]) == 32
    generated = to_rows(iter(["a", "b"]), [{"m": 1}, None], None)
    assert len(set(generated.ids)) == 2
    assert generated.metadatas == [{"m": 1}, None]
    assert generated.texts == ["a", "b"]


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((["a", "b"], [{}], None), ValueError, "metadatas has 1 entries but texts has 2"),
        ((["a"], None, ["x", "y"]), ValueError, "ids has 2 entries but texts has 1"),
        (("abc", None, None), TypeError, "not one string"),
        ((["a"], None, "x"), TypeError, "not one string"),
        ((["a", 3], None, None), TypeError, r"texts\[1\] must be a str"),
    ],
)
def test_to_rows_errors(args: tuple, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        to_rows(*args)


def test_as_matrix() -> None:
    assert as_matrix([[1, 2, 3]], 1, "e").shape == (1, 3)
    with pytest.raises(ValueError, match="different lengths"):
        as_matrix([[1, 2], [1, 2, 3]], 2, "embed_documents")
    with pytest.raises(ValueError, match=r"for 2 texts"):
        as_matrix([[1, 2, 3]], 2, "embed_documents")


# ------------------------------------------------------------------ construction


def test_store_construction_needs_no_sidecar() -> None:
    store = KalosVectorStore(EMB, name=absent_name(), timeout=0.5)
    assert store.client.timeout == 0.5
    assert not store.client.connected
    assert store.embeddings is EMB
    retriever = KalosRetriever(embedding=EMB, name=absent_name())
    assert retriever.k == 4
    assert retriever.on_error == "empty"
    assert store.as_retriever(search_kwargs={"k": 2}).search_kwargs == {"k": 2}



def test_as_retriever_refuses_search_kwargs_its_search_type_does_not_take() -> None:
    """``fetch_k`` left in after switching from "mmr" made every invoke raise TypeError (not
    degraded: the chain broke); it is refused when the retriever is made, naming the search
    type that takes it. Control: each type's own keys are accepted."""
    store = KalosVectorStore(EMB, name=absent_name())
    own = {
        "similarity": {"k": 2, "filter": {"a": 1}, "namespace": "n", "timeout": 0.5},
        "similarity_score_threshold": {"k": 2, "score_threshold": 0.5, "namespace": "n"},
        "mmr": {"k": 2, "fetch_k": 9, "lambda_mult": 0.3, "filter": {"a": 1}, "timeout": 0.5},
    }
    for search_type, kw in own.items():
        assert store.as_retriever(search_type=search_type, search_kwargs=kw).search_kwargs == kw
    with pytest.raises(ValueError, match=r"\['fetch_k'\] do not apply to search_type='similarity'.*'mmr' takes"):
        store.as_retriever(search_kwargs={"k": 2, "fetch_k": 5})
    with pytest.raises(ValueError, match=r"\['score_threshold'\].*'similarity_score_threshold' takes"):
        store.as_retriever(search_type="mmr", search_kwargs={"score_threshold": 0.5})
    with pytest.raises(ValueError, match=r"\['kk'\] do not apply") as e:
        store.as_retriever(search_kwargs={"kk": 2})
    assert "takes them" not in str(e.value)

def test_store_needs_exactly_one_of_name_and_client() -> None:
    with pytest.raises(ValueError, match=r"exactly one of name= .* and client="):
        KalosVectorStore(EMB)
    client = KalosClient(absent_name(), lazy=True)
    with pytest.raises(ValueError, match="exactly one"):
        KalosVectorStore(EMB, name="x", client=client)
    with pytest.raises(TypeError, match="Embeddings"):
        KalosVectorStore(object(), name="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        KalosVectorStore(EMB, name="x", timeout=0)


def test_retriever_field_checks() -> None:
    name = absent_name()
    with pytest.raises(TypeError, match=r"callable.*pass a dict"):
        KalosRetriever(embedding=EMB, name=name, filter=lambda d: True)
    with pytest.raises(ValidationError, match="top_k"):
        KalosRetriever(embedding=EMB, name=name, top_k=3)
    with pytest.raises(ValidationError, match="on_error"):
        KalosRetriever(embedding=EMB, name=name, on_error="ignore")
    with pytest.raises(ValidationError):
        KalosRetriever(embedding=EMB, name=name, k=0)
    with pytest.raises(ValidationError):
        KalosRetriever(embedding=EMB, name=name, score_threshold=1.5)
    with pytest.raises(ValueError, match=r"vectorstore=.*embedding="):
        KalosRetriever(name=name)
    with pytest.raises(ValidationError, match=r"\$bogus"):
        KalosRetriever(embedding=EMB, name=name, filter={"a": {"$bogus": 1}})


def test_invoke_argument_errors_raise_even_when_degrading() -> None:
    r = KalosRetriever(embedding=EMB, name=absent_name())
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['top_k'\]"):
        r.invoke("q", top_k=3)
    with pytest.raises(TypeError, match="callable"):
        r.invoke("q", filter=lambda d: True)
    with pytest.raises(ValueError, match="score_threshold"):
        r.invoke("q", score_threshold=2.0)
    assert r.degrader.degraded_calls == 0


def test_store_rejects_unknown_kwargs_and_callable_filters() -> None:
    store = KalosVectorStore(EMB, name=absent_name())
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        store.similarity_search("q", fliter={"a": 1})
    with pytest.raises(TypeError, match="callable"):
        store.similarity_search("q", filter=lambda d: True)
    with pytest.raises(TypeError, match="callable"):
        store.max_marginal_relevance_search("q", filter=lambda d: True)
    with pytest.raises(ValueError, match="needs ids or filter"):
        store.delete()
    with pytest.raises(ValueError, match="batch_size"):
        store.add_texts(["a"], batch_size=0)


def test_event_payload() -> None:
    d = Degrader("KalosRetriever(name='m')")
    exc = SidecarTimeout("slow")
    assert d.should_degrade(exc)
    data = _event_data(d, exc, "m", True)
    assert data == {"retriever": "KalosRetriever(name='m')", "sidecar": "m",
                    "error": "SidecarTimeout", "message": "slow", "first_in_episode": True,
                    "episodes": 1, "degraded_calls": 1}  # fmt: skip


def test_a_late_failure_of_a_call_begun_in_an_outage_opens_no_new_episode(caplog: pytest.LogCaptureFixture) -> None:
    """A sidecar that resumes answers the requests whose deadlines passed while it was paused
    "too late", after calls made since have succeeded: such a failure (its call began before
    the success that ended the episode) is degraded without a new episode or warning. (Before:
    one outage was logged and counted as two or three.) A call begun after the recovery that
    fails is a new outage; without ``started`` (a caller that does not say), as before."""
    import time

    caplog.set_level(logging.INFO, "kalos_retrievers")
    d = Degrader("KalosRetriever(name='m')")
    begun_in_outage = time.monotonic()
    assert d.should_degrade(SidecarTimeout("paused"), started=begun_in_outage)
    d.succeeded()
    assert d.should_degrade(SidecarTimeout("deadline passed before pickup"), started=begun_in_outage)
    assert (d.episodes, d.degraded_calls, d.in_episode) == (1, 2, False)
    assert d.should_degrade(SidecarTimeout("a new outage"), started=time.monotonic())
    assert (d.episodes, d.in_episode) == (2, True)
    d.succeeded()
    assert d.should_degrade(SidecarTimeout("no start given"))
    assert d.episodes == 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3


@pytest.mark.parametrize("mode", ["invoke", "ainvoke"])
def test_a_threshold_whose_metric_lookup_fails_degrades_like_the_recall(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a score threshold the retriever reads the sidecar's metric after the recall, from
    the header, which reconnects when another thread has found the sidecar gone meanwhile: a
    failure there escaped the degradation (on_error="empty" raised). Control: "raise" raises."""
    import asyncio

    import numpy as np

    from kalos_retrievers import RecallResult, SidecarUnavailable
    from kalos_retrievers.protocol import encode_doc

    docs = [encode_doc("a", "text a", b"{}", 1.0, 2.0)]
    res = RecallResult(np.array([0], np.int32), np.array([0.9], np.float32), docs, None, "")

    def gone(self: KalosClient) -> str:
        raise SidecarUnavailable("sidecar 'x' stopped during the call")

    monkeypatch.setattr(KalosVectorStore, "_recall", lambda self, *a, **kw: res)
    monkeypatch.setattr(KalosVectorStore, "_arecall", lambda self, *a, **kw: asyncio.sleep(0, res))
    monkeypatch.setattr(KalosClient, "metric", property(gone))
    for on_error in ("empty", "raise"):
        r = KalosRetriever(embedding=EMB, name=absent_name(), score_threshold=0.5, on_error=on_error)
        call = r.invoke if mode == "invoke" else (lambda q, r=r: asyncio.run(r.ainvoke(q)))
        if on_error == "empty":
            assert call("question") == [] and r.degrader.degraded_calls == 1
        else:
            with pytest.raises(SidecarUnavailable):
                call("question")


def test_a_degraded_errors_chain_is_kept_without_tracebacks() -> None:
    """``last_error`` keeps the error and what it chains to (a retry's first attempt), each
    without the frames that would keep the failed calls' connections alive."""

    def fail() -> None:
        try:
            raise SidecarTimeout("first attempt")
        except SidecarTimeout:
            raise SidecarTimeout("second attempt")  # noqa: B904 (chained as __context__)

    d = Degrader("KalosRetriever(name='m')")
    try:
        fail()
    except SidecarTimeout as e:
        assert e.__traceback__ is not None and e.__context__.__traceback__ is not None  # (the control)
        assert d.should_degrade(e)
    err = d.last_error
    assert str(err) == "second attempt" and str(err.__context__) == "first attempt"
    assert err.__traceback__ is None and err.__context__.__traceback__ is None
