# ruff: noqa  (a review's model of the dispatcher's start policy, session 51: run from this folder with PYTHONPATH=.:../../../../tests:../../../.. python s2.py)
from sim import *
LONG = b'{"user":"u1","tags":{"$in":[%s]}}' % b",".join(b'"tag%03d"' % i for i in range(20))
cases = {
  "long filter (>128 B)": dict(ns="mem", flt=LONG),
  "invalid filter": dict(ns="mem", flt=b'{"user":{"$bogus":1}}'),
  "empty namespace": dict(ns="ghost", flt=None),
  "empty ns + filter": dict(ns="ghost", flt=b'{"user":"u1"}'),
  "filters off (args 0)": dict(ns="mem", flt=b'{"user":"u1"}', args_max=0),
  "valid, v1.5 client (not rung)": dict(ns="mem", flt=b'{"user":"u1"}', rings=False),
}
def run(case, old, n=600, gap=2*MS, writes=False, a_scope=None):
    c = cases[case]
    s = Sim(old=old, args_max=c.get("args_max", 128), users=5)
    for j in range(n):
        if writes: s.write(); s.idle(gap)
        if a_scope: s.recall("mem", a_scope)
        else: s.recall("", None)
        s.idle(gap)
        s.recall(c["ns"], c["flt"], rings=c.get("rings", True))
        s.idle(gap)
    return s.report()
print("A = default-namespace client, B = the case; A, 2ms, B, 2ms x600")
for case in cases:
    print(f"{case:30s} old", run(case, True)); print(f"{'':30s} new", run(case, False))
print("\nsame, A a filtered user u2 of the table, with an add before each A")
for case in cases:
    print(f"{case:30s} old", run(case, True, writes=True, a_scope=b'{"user":"u2"}')); print(f"{'':30s} new", run(case, False, writes=True, a_scope=b'{"user":"u2"}'))
