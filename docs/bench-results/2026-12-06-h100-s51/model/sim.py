# ruff: noqa  (a review's model of the dispatcher's start policy, session 51: run from this folder with PYTHONPATH=.:../../../../tests:../../../.. python sim.py)
"""Model of the serve loop around the real Dispatcher/Service/Server policy code, a stand-in
kernel and a stand-in clock. Events: recall(user scope) / write, with pauses between."""
import sys, time, random, json
sys.path.insert(0, "/work/main/tests/unit")
sys.path.insert(0, "/work/main")
import numpy as np
import test_dispatcher_batch as T
from kalos_retrievers.protocol import encode_recall_args, SlotState
import kalos_retrievers.sidecar.dispatcher as dmod
import kalos_retrievers.sidecar.server as smod
from kalos_retrievers.sidecar.server import Server

CLOCK = {"ns": 10**12}
time.monotonic_ns = lambda: CLOCK["ns"]

MS = 1_000_000

class Sim:
    def __init__(self, old=False, spaces=8, args_max=128, users=50):
        k, dim = 3, 5
        self.lay, self.mm, self.svc, _, self.d, self.states, _ = T._arena_rig(n_slots=2, dim=dim, rows=40)
        rng = np.random.default_rng(1)
        n = max(users, 3)
        self.svc.upsert({"namespace": "mem", "ids": [f"m{i}" for i in range(n)], "texts": ["t"] * n,
                         "metadatas": [{"user": f"u{i}"} for i in range(n)]},
                        rng.standard_normal((n, dim)).astype(np.float32))
        idx = self.idx = self.svc.index
        idx.doorbell_k, idx.doorbell_spaces, idx.doorbell_args = 16, spaces, args_max
        self.served = 0
        idx.doorbell_served = lambda: self.served
        idx.doorbell_running = False
        idx.bell_served_spaces = ()
        self.starts = 0
        def resume(high, ns, sp=(), touched=None):
            idx.doorbell_running = True
            idx.bell_served_spaces = tuple(s.args if hasattr(s, "args") else s[0] for s in list(sp)[:spaces])
            self.starts += 1
        def pause():
            idx.doorbell_running = False
        idx.resume_doorbell, idx.pause_doorbell = resume, pause
        np.frombuffer(self.mm, np.float32, dim, self.lay.slot_offset(0) + self.lay.payload_offset)[:] = rng.standard_normal(dim)
        srv = self.srv = Server.__new__(Server)
        srv.service, srv.dispatcher = self.svc, self.d
        srv._bell_rearm = srv._bell_wanted = False
        srv._bell_fruitless = 0
        srv._bell_idle = (0, 0)
        srv._publish_doorbell = lambda *a: None
        def failed():
            raise
        srv._doorbell_failed = failed
        if old:  # (the dispatcher before 5a3a39a: every decline backs off, a new scope decoded at its second recall)
            self.d._learned = lambda *a: False
            first_time = self.d._bell_space
            self.d._bell_space = lambda i, req, now=False: first_time(i, req)
        self.k, self.dim, self.seq = k, dim, 0
        self.last_work = CLOCK["ns"]
        self.host = self.kern = self.stops = 0

    def idle(self, ns):
        """Time passes with nothing to do: the loop may start the kernel on idle."""
        end = CLOCK["ns"] + ns
        t = max(CLOCK["ns"], self.last_work + smod.BELL_REARM_NS)
        if t <= end:
            CLOCK["ns"] = t
            self.srv._rearm_bell(t, self.last_work)
        CLOCK["ns"] = end

    def _pass(self, fn):
        d, idx = self.d, self.idx
        was, declines, lone = idx.doorbell_running, d.kernel_declines, d.lone
        fn()
        stopped = was and not idx.doorbell_running
        self.stops += stopped
        self.srv._after_pass(d, stopped, declines, lone)
        if d.lone_enough(dmod.LONE_RECALLS):
            self.srv._resume_doorbell_if_idle()
        CLOCK["ns"] += 300_000  # a host answer's time
        self.last_work = CLOCK["ns"]

    def recall(self, namespace="mem", flt=None, rings=True, servable=None):
        idx = self.idx
        args = encode_recall_args(namespace, flt) if (namespace or flt) else b""
        from kalos_retrievers.protocol import ringable_args
        ringable = not args or ringable_args(len(args), len(namespace.encode()), idx.doorbell_args)
        if idx.doorbell_running and rings and ringable and (not args or args in idx.bell_served_spaces):
            self.served += 1; self.kern += 1
            CLOCK["ns"] += 60_000
            return "k"
        self.host += 1
        def go():
            self.seq += 1
            T._write_scoped_recall(self.mm, self.lay, 0, self.seq, self.k, self.dim, namespace, flt, SlotState.REQUEST)
            assert self.d.poll() == 1
            self.d.settle()
        self._pass(go)
        return "h"

    def write(self):
        def go():
            self.idx.doorbell_running = False
            self.d.lone = 0
        self._pass(go)

    def report(self):
        d = self.d
        return dict(starts=self.starts, stops=self.stops, kern=self.kern, host=self.host,
                    learns=d.kernel_learns, declines=d.kernel_declines)
