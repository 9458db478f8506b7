"""The handbook through LlamaIndex: an index over KalosVectorStore and its query engine.

    python examples/llamaindex_query.py                    # five sample questions
    python examples/llamaindex_query.py "How long are Beacon access tokens valid?"
    python examples/llamaindex_query.py --questions examples/data/questions.jsonl   # with hit@5
    python examples/llamaindex_query.py --sidecar docs     # a running sidecar (--dim 384)

The same corpus as rag_chain.py, stored as LlamaIndex TextNodes (one per passage, id = the
passage id) in a Kalos sidecar. The index is ``VectorStoreIndex.from_vector_store(
KalosVectorStore(...))``; its query engine retrieves from the sidecar and synthesizes the
answer with the LLM. Prints the answer, the nodes with their scores and the recall latency.
Offline unless configured: see examples/common.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llama_index.core import PromptTemplate, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.llms import CompletionResponse, CompletionResponseGen, CustomLLM, LLMMetadata
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import MetadataMode, QueryBundle, TextNode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `python -P` leaves it off sys.path
import common
from common import say

from kalos_retrievers.llama_index import KalosVectorStore

# LlamaIndex fills {context_str} with the nodes' LLM content: "[id] text" (see make_node).
QA_TEMPLATE = PromptTemplate(common.PROMPT.format(context="{context_str}", question="{query_str}"))


class ExampleEmbedding(BaseEmbedding):
    """The examples' LangChain embeddings (MiniLM or hashing) behind LlamaIndex's interface."""

    _inner: Any = PrivateAttr()

    def __init__(self, inner: Any, name: str) -> None:
        super().__init__(model_name=name, embed_batch_size=64)
        self._inner = inner

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._inner.embed_query(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._inner.embed_documents([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._inner.embed_documents(texts)


class ExampleLLM(CustomLLM):
    """The configured OpenAI-compatible endpoint, or the offline extractive model."""

    endpoint: dict[str, str] | None = None
    offline: Any = None
    name: str = "offline"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=8192, num_output=512, model_name=self.name)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(
            text=common.complete([("user", prompt)], self.endpoint, self.offline)
        )

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        text = self.complete(prompt, formatted).text
        yield CompletionResponse(text=text, delta=text)


def make_node(p: dict[str, Any]) -> TextNode:
    """One passage as a node. Only the text is embedded (as in rag_chain.py); the LLM sees
    "[id] text", so answers can cite passages."""
    meta = {"passage": p["id"], "title": p["title"], **p["metadata"]}
    return TextNode(
        id_=p["id"],
        text=p["text"],
        metadata=meta,
        excluded_embed_metadata_keys=list(meta),
        excluded_llm_metadata_keys=[k for k in meta if k != "passage"],
        metadata_template="{value}",
        text_template="[{metadata_str}] {content}",
    )


def load_corpus(store: KalosVectorStore, embed: BaseEmbedding) -> None:
    corpus = common.passages()
    have = store.client.count(store.namespace)
    if have == len(corpus):
        say(f"corpus: {have} nodes already in namespace {store.namespace!r}")
        return
    nodes = [make_node(p) for p in corpus]

    def write(lo: int, hi: int) -> None:
        batch = nodes[lo:hi]
        texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in batch]
        for n, v in zip(batch, embed.get_text_embedding_batch(texts), strict=True):
            n.embedding = v
        store.add(batch)

    took = common.load_in_batches(len(nodes), write, "handbook nodes")
    say(
        f"corpus: {len(nodes)} nodes embedded and stored in {took:.1f} s "
        f"(namespace {store.namespace!r})"
    )


def ask(
    engine: RetrieverQueryEngine, emb: common.TimedEmbeddings, q: dict[str, Any]
) -> dict[str, Any]:
    bundle = QueryBundle(q["question"])
    # engine.query() is retrieve() then synthesize(); called apart here to time the recall.
    t0 = time.perf_counter()
    nodes = engine.retrieve(bundle)
    retrieve_s = time.perf_counter() - t0
    response = engine.synthesize(bundle, nodes)
    expected = set(q.get("answer_ids", []))
    say(f"\n{q['id']}  {q['question']}")
    say(f"A:  {str(response).strip()}")
    say(
        f"    retrieved {len(nodes)} nodes in {retrieve_s * 1000:.2f} ms (embedding the question "
        f"{emb.last_query_s * 1000:.2f} ms, sidecar round trip and LlamaIndex "
        f"{(retrieve_s - emb.last_query_s) * 1000:.2f} ms):"
    )
    recalled = []
    for n in nodes:
        mark = "  <- expected" if n.node.node_id in expected else ""
        say(f"      {n.score:.3f}  {n.node.node_id}  {n.node.metadata.get('title', '')}{mark}")
        recalled.append({"id": n.node.node_id, "score": n.score})
    return {
        **q,
        "answer": str(response).strip(),
        "recalled": recalled,
        "retrieve_ms": retrieve_s * 1000,
        "embed_ms": emb.last_query_s * 1000,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_question_args(ap)
    common.add_common_args(ap)
    args = ap.parse_args(argv)

    model, emb_name = common.make_embeddings(args.embeddings)
    emb = common.TimedEmbeddings(model)
    chat, llm_name = common.make_llm(args.llm, model)
    llm = ExampleLLM(endpoint=chat.endpoint, offline=chat.offline, name=llm_name)
    embed_model = ExampleEmbedding(emb, emb_name)
    say(f"embeddings: {emb_name} ({common.DIM} dimensions)")
    say(f"LLM: {llm_name}")
    qs = common.pick_questions(args)
    with common.sidecar_client(args.sidecar, device=args.device) as (client, _):
        store = KalosVectorStore(client=client, namespace=f"llamaindex/{emb_name}", timeout=0.5)
        load_corpus(store, embed_model)
        index = VectorStoreIndex.from_vector_store(store, embed_model=embed_model)
        engine = index.as_query_engine(
            llm=llm, similarity_top_k=args.k, text_qa_template=QA_TEMPLATE
        )
        results = [ask(engine, emb, q) for q in qs]

    say("")
    hits, graded = common.hit_rate(results, k=5)
    if graded:
        say(f"hit@5: {hits}/{graded} = {hits / graded:.2f} (embeddings {emb_name})")
    lat = [(r["retrieve_ms"] - r["embed_ms"]) / 1000 for r in results]
    say(f"retrieval latency without the embedding: {common.percentiles_ms(lat)}")
    if args.json:
        report = {
            "example": "llamaindex_query",
            "embeddings": emb_name,
            "llm": llm_name,
            "k": args.k,
            "results": results,
        }
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
