"""A LangGraph agent whose long-term memory is a Kalos sidecar (KalosStore, LangGraph's BaseStore).

    python examples/langgraph_agent.py                     # interactive; /help lists commands
    python examples/langgraph_agent.py --script examples/data/langgraph_chat.txt
    printf 'I drink tea.\\nWhat do I drink?\\n' | python examples/langgraph_agent.py

Needs the ``langgraph`` extra (``pip install ".[langgraph]"`` in the checkout). The graph is

    START -> recall -> respond -> remember -> END

* ``recall`` searches the store namespace ``("users", <user>, "memories")`` for the items
  closest to the message (in the sidecar, with the user's namespace as the partition);
* ``respond`` asks the LLM, with the recalled memories as context and the thread's earlier
  messages (short-term memory: LangGraph's checkpointer, one thread per user and session);
* ``remember`` puts a statement (anything that is not a question) into the store, keyed by
  its text: a statement told again replaces its memory rather than adding a copy.

``/user NAME`` switches user: each user sees only their own memories. The sidecar keeps them in
``--data-dir`` (default ~/.cache/kalos-examples/langgraph-agent/<embedder>), so a new session
remembers. Offline unless configured: see examples/common.py.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

try:
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.store.base import BaseStore
except ImportError:  # pragma: no cover - the message is the point
    sys.exit('langgraph_agent.py needs LangGraph: pip install ".[langgraph]" in the Kalos checkout')

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `python -P` leaves it off sys.path
import common
from common import say

from kalos_retrievers import KalosError
from kalos_retrievers.langgraph import KalosStore

SYSTEM = (
    "You are a helpful assistant. The context holds what this user told you in earlier "
    "conversations; use it when relevant and never invent memories."
)
HELP = "commands: /user NAME (switch user), /memories (the current user's), /quit"


class State(MessagesState):
    user: str
    recalled: list[dict[str, Any]]


def memories_of(user: str) -> tuple[str, ...]:
    """The namespace of a user's memories. LangGraph refuses a label with a "." (an email,
    say), so the name is percent-encoded there."""
    return ("users", user.replace("%", "%25").replace(".", "%2E"), "memories")


def build_graph(llm: Any, *, k: int = 3, min_score: float = 0.2) -> StateGraph:
    """The agent's graph (compile it with a store and a checkpointer)."""

    def recall(state: State, *, store: BaseStore) -> dict[str, Any]:
        question = str(state["messages"][-1].content)
        t0 = time.perf_counter()
        items = store.search(memories_of(state["user"]), query=question, limit=k)  # [] if down
        took = time.perf_counter() - t0
        found = [
            {"key": i.key, "text": i.value["text"], "score": i.score}
            for i in items
            if i.score is not None and i.score >= min_score
        ]
        shown = " | ".join(f'{m["score"]:.2f} "{m["text"]}"' for m in found) or "nothing"
        say(f"     recall: {shown} ({took * 1000:.1f} ms)")
        return {"recalled": found}

    def respond(state: State) -> dict[str, Any]:
        *history, last = state["messages"]
        context = "\n".join(f"[m{i}] {m['text']}" for i, m in enumerate(state["recalled"], 1))
        prompt = common.PROMPT.format(context=context, question=last.content)
        reply = llm.invoke([SystemMessage(SYSTEM), *history[-8:], HumanMessage(prompt)])
        return {"messages": [AIMessage(str(reply.content))]}

    def remember(state: State, *, store: BaseStore) -> dict[str, Any]:
        said = str(state["messages"][-2].content)  # the user's message before the reply
        if common.looks_like_question(said):
            return {}
        try:
            # keyed by the text: a statement told again (or the script run again) replaces
            # its memory instead of adding a duplicate that would crowd the next recall
            key = hashlib.sha256(said.strip().encode()).hexdigest()[:32]
            store.put(memories_of(state["user"]), key, {"text": said})
        except KalosError as e:  # writes raise (a silently lost memory is worse)
            say(f"     (not remembered: {e})")
        return {}

    builder = StateGraph(State)
    builder.add_node("recall", recall)
    builder.add_node("respond", respond)
    builder.add_node("remember", remember)
    builder.add_edge(START, "recall")
    builder.add_edge("recall", "respond")
    builder.add_edge("respond", "remember")
    builder.add_edge("remember", END)
    return builder


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--user", default="alice", help="who is talking first (default alice)")
    ap.add_argument("--script", metavar="FILE", help="read the user's messages from FILE")
    ap.add_argument(
        "--data-dir",
        help="where a started sidecar keeps memories "
        "(default ~/.cache/kalos-examples/langgraph-agent/<embedder>)",
    )
    common.add_common_args(ap)
    args = ap.parse_args(argv)

    model, emb_name = common.make_embeddings(args.embeddings)
    llm, llm_name = common.make_llm(args.llm, model)
    say(f"embeddings: {emb_name}; LLM: {llm_name}")
    data_dir = args.data_dir or common.default_data_dir("langgraph-agent", emb_name)
    with common.sidecar_client(args.sidecar, device=args.device, data_dir=data_dir) as (
        client,
        _,
    ):
        store = KalosStore(
            client=client,
            timeout=0.5,
            index={"dims": common.DIM, "embed": model, "fields": ["text"]},
        )
        graph = build_graph(llm).compile(store=store, checkpointer=InMemorySaver())
        session, user = uuid.uuid4().hex[:8], args.user
        say(f"user {user!r}; /help for commands\n")
        for line in common.chat_lines(args.script):
            if line.startswith("/"):
                cmd, _, arg = line.partition(" ")
                if cmd in ("/quit", "/exit"):
                    break
                if cmd == "/user" and arg.strip():
                    user = arg.strip()
                    say(f"     (now talking to {user!r})")
                elif cmd == "/memories":
                    items = store.search(memories_of(user), limit=100)
                    say(
                        f"     {len(items)} memories of {user!r}: "
                        + " | ".join(i.value["text"] for i in items)
                    )
                else:
                    say(HELP)
                continue
            config = {"configurable": {"thread_id": f"{session}/{user}"}}
            out = graph.invoke({"messages": [HumanMessage(line)], "user": user}, config)
            say(f"bot> {out['messages'][-1].content}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
