"""A chat agent with long-term memory in a Kalos sidecar (KalosMemory).

    python examples/agent_memory_chat.py                   # interactive; /help lists commands
    python examples/agent_memory_chat.py --script examples/data/chat_day1.txt
    python examples/agent_memory_chat.py --script examples/data/chat_day2.txt   # a new session
    printf 'I live in Utrecht.\\nWhere do I live?\\n' | python examples/agent_memory_chat.py

Every turn recalls the user's memories closest to the message and answers from them; what the
user states (anything that is not a question) is stored as a new memory, scoped to ``--user``.
The sidecar keeps memories in ``--data-dir`` (default ~/.cache/kalos-examples/agent-memory/
<embedder>), so the next session, in a new process, still knows them. If the sidecar stops
mid-conversation, the agent says so once and keeps answering with empty memory; when the
sidecar is back, so is the memory. Offline unless configured: see examples/common.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `python -P` leaves it off sys.path
import common
from common import say

from kalos_retrievers import KalosError, Sidecar
from kalos_retrievers.memory import KalosMemory

SYSTEM = (
    "You are a helpful assistant with a long-term memory of what the user told you in "
    "earlier conversations. Use the recalled memories when they are relevant; never "
    "invent memories."
)
OFFLINE_NOTICE = (
    "(memory offline: the Kalos sidecar is not answering, so I am answering "
    "without long-term memory, and what you tell me now is not saved)"
)
BACK_NOTICE = "(memory is back)"
HELP = """commands: /memories (what I remember about you), /forget (delete it all),
          /stop-sidecar and /start-sidecar (when this process started the sidecar: see the
          agent degrade and recover), /quit"""


class MemoryAgent:
    """One user's conversation: short-term history in this process, long-term in KalosMemory.

    Args:
        memory: the long-term store.
        embeddings: the model ``memory`` embeds with (timed, to report the recall latency).
        llm: a LangChain chat model.
        user: whose memories to read and write.
        k: memories recalled per turn.
        min_score: memories less similar to the message than this are not recalled.
    """

    def __init__(
        self,
        memory: KalosMemory,
        embeddings: common.TimedEmbeddings,
        llm: BaseChatModel,
        *,
        user: str,
        k: int = 3,
        min_score: float = 0.2,
    ) -> None:
        self.memory = memory
        self.embeddings = embeddings
        self.min_score = min_score
        self.llm = llm
        self.user = user
        self.k = k
        self.session = uuid.uuid4().hex[:8]
        self.history: list[BaseMessage] = []
        self.offline = False  # the notice has been shown for the current outage

    def turn(self, text: str) -> str:
        t0 = time.perf_counter()
        hits = self.memory.search(
            text, user_id=self.user, limit=self.k, threshold=self.min_score
        )  # [] while degraded
        took = time.perf_counter() - t0
        embed_ms = f"{self.embeddings.last_query_s * 1000:.1f} ms of it embedding"
        self._notice(self.memory.degrader.in_episode)
        if hits:
            shown = " | ".join(f'{h["score"]:.2f} "{h["memory"]}"' for h in hits)
            say(
                f"     recalled {len(hits)} {'memory' if len(hits) == 1 else 'memories'} in "
                f"{took * 1000:.1f} ms ({embed_ms}): {shown}"
            )
        elif not self.offline:
            say(f"     recalled nothing ({took * 1000:.1f} ms, {embed_ms})")
        if not common.looks_like_question(text):
            self._remember(text)
        context = "\n".join(f"[m{i}] {h['memory']}" for i, h in enumerate(hits, 1))
        prompt = common.PROMPT.format(context=context, question=text)
        messages = [SystemMessage(SYSTEM), *self.history[-8:], HumanMessage(prompt)]
        reply = str(self.llm.invoke(messages).content)
        self.history += [HumanMessage(text), AIMessage(reply)]
        return reply

    def _remember(self, text: str) -> None:
        try:
            self.memory.add(text, user_id=self.user, metadata={"session": self.session})
        except KalosError as e:
            if not e.transient:
                raise
            self._notice(True)  # writes raise rather than degrade; same outage, same notice

    def _notice(self, down: bool) -> None:
        """Show the offline notice once per outage, and say when memory is back."""
        if down and not self.offline:
            say(OFFLINE_NOTICE)
        elif not down and self.offline:
            say(BACK_NOTICE)
        self.offline = down

    def list_memories(self) -> None:
        try:
            mems = self.memory.get_all(user_id=self.user, limit=1000)
        except KalosError as e:
            say(f"     (cannot list memories: {e})")
            return
        say(f"     {len(mems)} memories of {self.user!r}:")
        for m in mems:
            say(f"       {m['created_at'][:19]}  {m['memory']}")


def command(line: str, agent: MemoryAgent, sidecar: Sidecar | None) -> bool:
    """Run a /command; False means quit."""
    cmd = line.split(maxsplit=1)[0]
    if cmd in ("/quit", "/exit"):
        return False
    if cmd == "/memories":
        agent.list_memories()
    elif cmd == "/forget":
        say(f"     forgot {agent.memory.delete_all(user_id=agent.user)} memories")
    elif cmd in ("/stop-sidecar", "/start-sidecar") and sidecar is None:
        say("     (the sidecar was not started by this process; stop it with kalos-sidecar stop)")
    elif cmd == "/stop-sidecar":
        assert sidecar is not None
        sidecar.stop()
        say(f"     (sidecar {sidecar.name!r} stopped)")
    elif cmd == "/start-sidecar":
        assert sidecar is not None
        sidecar.start()
        say(f"     (sidecar {sidecar.name!r} started again, pid {sidecar.pid})")
    else:
        say(HELP)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--user", default="alice", help="whose memories (default alice)")
    ap.add_argument("--script", metavar="FILE", help="read the user's messages from FILE")
    ap.add_argument(
        "--data-dir",
        help="where a started sidecar keeps memories "
        "(default ~/.cache/kalos-examples/agent-memory/<embedder>)",
    )
    ap.add_argument("--timeout", type=float, default=0.5, help="deadline of each memory call (s)")
    common.add_common_args(ap)
    args = ap.parse_args(argv)
    # The agent tells the user about an outage itself (once); the library's own warning would
    # say it a second time, on stderr, in the middle of the conversation.
    logging.getLogger("kalos_retrievers").setLevel(logging.ERROR)

    model, emb_name = common.make_embeddings(args.embeddings)
    llm, llm_name = common.make_llm(args.llm, model)
    say(f"embeddings: {emb_name}; LLM: {llm_name}")
    data_dir = args.data_dir or common.default_data_dir("agent-memory", emb_name)
    with common.sidecar_client(args.sidecar, device=args.device, data_dir=data_dir) as (
        client,
        sidecar,
    ):
        emb = common.TimedEmbeddings(model)
        memory = KalosMemory(client=client, embedding=emb, collection="chat", timeout=args.timeout)
        agent = MemoryAgent(memory, emb, llm, user=args.user)
        n = len(memory.get_all(user_id=args.user, limit=1000))
        say(f"memory: {n} memories of {args.user!r} from earlier sessions; /help for commands\n")
        for line in common.chat_lines(args.script):
            if line.startswith("/"):
                if not command(line, agent, sidecar):
                    break
                continue
            say(f"bot> {agent.turn(line)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
