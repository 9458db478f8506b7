"""RAG over a company handbook: a LangChain LCEL chain with KalosRetriever.

    python examples/rag_chain.py                           # five sample questions
    python examples/rag_chain.py "Who is the data protection officer?"
    python examples/rag_chain.py --questions examples/data/questions.jsonl   # all, with hit@5
    python examples/rag_chain.py --sidecar mem             # a running sidecar (--dim 384)

Loads examples/data/handbook.jsonl (345 passages of the fictional Tallwood Systems handbook)
into a Kalos sidecar through KalosVectorStore, then answers each question with

    {"docs": KalosRetriever, "question": passthrough}.assign(answer=prompt | llm)

and prints the answer, the passages recalled with their scores, and the recall latency.
Offline unless configured: see examples/common.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from operator import itemgetter
from pathlib import Path
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `python -P` leaves it off sys.path
import common
from common import say

from kalos_retrievers import KalosClient, KalosError
from kalos_retrievers.langchain import KalosRetriever, KalosVectorStore


class RecallTimer(BaseCallbackHandler):
    """Times each retriever run of the chain (query embedding + sidecar round trip)."""

    def __init__(self) -> None:
        self.started: dict[UUID, float] = {}
        self.last_s = 0.0

    def on_retriever_start(self, serialized: Any, query: str, *, run_id: UUID, **kw: Any) -> None:
        self.started[run_id] = time.perf_counter()

    def on_retriever_end(self, documents: Any, *, run_id: UUID, **kw: Any) -> None:
        self.last_s = time.perf_counter() - self.started.pop(run_id)


def format_docs(docs: list[Document]) -> str:
    return "\n".join(f"[{d.id}] {d.page_content}" for d in docs)


def build_chain(retriever: KalosRetriever, llm: Runnable) -> Runnable:
    """question -> {"docs", "question", "answer"}."""
    prompt = ChatPromptTemplate.from_template(common.PROMPT)
    answer = (
        {
            "context": itemgetter("docs") | RunnableLambda(format_docs),
            "question": itemgetter("question"),
        }
        | prompt
        | llm
        | StrOutputParser()
    )
    return RunnableParallel(docs=retriever, question=RunnablePassthrough()).assign(answer=answer)


def load_corpus(store: KalosVectorStore, namespace: str) -> None:
    corpus = common.passages()
    have = store.client.count(namespace)
    if have == len(corpus):
        say(f"corpus: {have} passages already in namespace {namespace!r}")
        return
    texts = [p["text"] for p in corpus]
    metas = [{"title": p["title"], **p["metadata"]} for p in corpus]
    ids = [p["id"] for p in corpus]

    def write(lo: int, hi: int) -> None:
        store.add_texts(texts[lo:hi], metadatas=metas[lo:hi], ids=ids[lo:hi])

    took = common.load_in_batches(len(corpus), write, "handbook passages")
    say(
        f"corpus: {len(corpus)} passages embedded and stored in {took:.1f} s "
        f"(namespace {namespace!r})"
    )


def ask(
    chain: Runnable,
    q: dict[str, Any],
    *,
    k: int,
    timer: RecallTimer,
    emb: common.TimedEmbeddings,
    client: KalosClient,
    namespace: str,
) -> dict[str, Any]:
    out = chain.invoke(q["question"], config={"callbacks": [timer]})
    retrieve_s, embed_s = timer.last_s, emb.last_query_s
    # KalosRetriever returns Documents without scores (by design: nothing is added to their
    # metadata), so the scores come from the same recall asked of the client directly; being
    # a bare round trip, it also times the sidecar alone.
    scores: dict[str, float] = {}
    sidecar_s = None
    if out["docs"]:
        try:
            t0 = time.perf_counter()
            res = client.recall(emb.last_query, k=k, namespace=namespace, timeout=0.5)
            sidecar_s = time.perf_counter() - t0
            scores = {h.id: float(h.score) for h in res}
        except KalosError as e:
            say(f"   (scores unavailable: {e})")
    expected = set(q.get("answer_ids", []))
    say(f"\n{q['id']}  {q['question']}")
    say(f"A:  {out['answer']}")
    rt = f"; the scores' own recall {sidecar_s * 1000:.2f} ms" if sidecar_s is not None else ""
    say(
        f"    recalled {len(out['docs'])} passages in {retrieve_s * 1000:.2f} ms "
        f"(of which embedding the question {embed_s * 1000:.2f} ms{rt}):"
    )
    recalled = []
    for d in out["docs"]:
        score = scores.get(str(d.id))
        mark = "  <- expected" if d.id in expected else ""
        shown = f"{score:.3f}" if score is not None else "  ?  "
        say(f"      {shown}  {d.id}  {d.metadata.get('title', '')}{mark}")
        recalled.append({"id": d.id, "score": score, "title": d.metadata.get("title")})
    return {
        **q,
        "answer": out["answer"],
        "recalled": recalled,
        "retrieve_ms": retrieve_s * 1000,
        "embed_ms": embed_s * 1000,
        "sidecar_ms": None if sidecar_s is None else sidecar_s * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_question_args(ap)
    common.add_common_args(ap)
    args = ap.parse_args(argv)

    model, emb_name = common.make_embeddings(args.embeddings)
    emb = common.TimedEmbeddings(model)
    llm, llm_name = common.make_llm(args.llm, model)
    say(f"embeddings: {emb_name} ({common.DIM} dimensions)")
    say(f"LLM: {llm_name}")
    namespace = f"handbook/{emb_name}"  # one per embedder: vectors of two models never mix
    qs = common.pick_questions(args)
    timer = RecallTimer()
    with common.sidecar_client(args.sidecar, device=args.device) as (client, _):
        store = KalosVectorStore(emb, client=client, namespace=namespace)
        load_corpus(store, namespace)
        retriever = KalosRetriever(vectorstore=store, k=args.k, timeout=0.5)
        chain = build_chain(retriever, llm)
        results = [
            ask(chain, q, k=args.k, timer=timer, emb=emb, client=client, namespace=namespace)
            for q in qs
        ]

    say("")
    hits, graded = common.hit_rate(results, k=5)
    if graded:
        say(
            f"hit@5: {hits}/{graded} = {hits / graded:.2f} (answer passage among the first 5 "
            f"recalled; embeddings {emb_name})"
        )
    rts = [r["sidecar_ms"] / 1000 for r in results if r["sidecar_ms"] is not None]
    say(f"sidecar recall latency: {common.percentiles_ms(rts)}")
    if args.json:
        report = {
            "example": "rag_chain",
            "embeddings": emb_name,
            "llm": llm_name,
            "k": args.k,
            "results": results,
        }
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
