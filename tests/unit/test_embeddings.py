"""HashingEmbeddings: the offline lexical embedder the demo and the examples fall back to."""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kalos_retrievers.embeddings import _STOP, HashingEmbeddings

E = HashingEmbeddings(dim=257)
OLD_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")  # the ASCII-only tokenizer before session 45


def cos(a: str, b: str) -> float:
    va, vb = E.embed_documents([a, b])
    return float(np.dot(va, vb))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80))
def test_ascii_text_gets_the_words_it_always_got(text: str) -> None:
    """Vectors of ASCII text are unchanged by the Unicode tokenizer, so stores filled with
    them by an earlier version still answer the same queries."""
    words = [w for w in OLD_TOKEN.findall(text.lower()) if w not in _STOP]
    old = Counter(words)
    old.update(f"{a} {b}" for a, b in itertools.pairwise(words))
    assert E._features(text) == old


def test_words_in_other_scripts_are_features() -> None:
    """Non-ASCII letters were dropped: texts in Cyrillic, Greek or Han with no digits had no
    features at all and all got the same fallback vector (cosine 1.0 between unrelated texts);
    accented words were cut ("café" -> "caf")."""
    assert cos("退款政策", "天气很好") == pytest.approx(0.0, abs=0.2)
    assert cos("возврат денег", "хорошая погода") == pytest.approx(0.0, abs=0.2)
    assert cos("Müller zahlt", "Mahler spielt") == pytest.approx(0.0, abs=0.2)
    assert list(E._features("café crème")) == ["café", "crème", "café crème"]
    assert cos("我们的退款政策", "退款政策是什么") > 0.4  # shared characters and character bigrams
    assert cos("STRASSE", "straße") == pytest.approx(1.0)  # case-folded
    assert list(E._features("日本語")) == ["日", "本", "語", "日 本", "本 語"]
    # combining marks belong to their word, in either Unicode form (they cut words apart:
    # "Mu" + U+0308 was "mu" and "ller"; a Devanagari word fell into its consonants)
    nfd = unicodedata.normalize("NFD", "Müller naïve")
    assert cos(nfd, "Müller naïve") == pytest.approx(1.0)
    assert list(E._features("हिन्दी भाषा"))[:2] == ["हिन्दी", "भाषा"]
    assert list(E._features("qu'il dit é"))[:3] == ["qu'il", "dit", "é"]  # ("'" kept on, as for ASCII)


def test_vectors_are_unit_deterministic_and_never_zero() -> None:
    a = HashingEmbeddings(dim=64).embed_query("refunds within 30 days")
    assert a == HashingEmbeddings(dim=64).embed_query("refunds within 30 days")
    assert float(np.linalg.norm(a)) == pytest.approx(1.0, abs=1e-6)
    for empty in ("", "the of and", "!!!"):  # no content words: a fixed unit vector
        v = np.array(E.embed_query(empty))
        assert float(np.linalg.norm(v)) == pytest.approx(1.0) and v[0] == 1.0
    with pytest.raises(ValueError, match="dim=4"):
        HashingEmbeddings(dim=4)


def test_async_embeds_on_the_loop_not_behind_the_default_executor() -> None:
    """``aembed_*`` give what the sync methods give without the loop's default executor: with
    its threads all held (sync calls an app runs there, each held by a paused sidecar for its
    timeout), they still return at once. Control: LangChain's base ``aembed_query`` (the old
    behaviour) waits for a thread."""
    import asyncio
    import concurrent.futures
    import threading
    import time

    from langchain_core.embeddings import Embeddings

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        release = threading.Event()
        held = [loop.run_in_executor(None, release.wait, 5) for _ in range(2)]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        assert await E.aembed_query("refund window") == E.embed_query("refund window")
        assert await E.aembed_documents(["a b", "c d"]) == E.embed_documents(["a b", "c d"])
        ours = time.monotonic() - t0
        loop.call_later(0.3, release.set)
        t0 = time.monotonic()
        await Embeddings.aembed_query(E, "refund window")  # the base class's: the default executor
        base = time.monotonic() - t0
        await asyncio.gather(*held)
        return ours, base

    ours, base = asyncio.run(main())
    assert ours < 0.1 and base > 0.2
