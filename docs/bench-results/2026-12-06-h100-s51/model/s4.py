# ruff: noqa  (a review's model of the dispatcher's start policy, session 51: run from this folder with PYTHONPATH=.:../../../../tests:../../../.. python s4.py)
from sim import *
def stream(old, interval, twice, n=1000, steady=True, seed=0):
    s = Sim(old=old, users=5)
    rnd = random.Random(seed)
    t0 = CLOCK["ns"]
    for u in range(n):
        flt = b'{"user":"new%d"}' % u
        reps = 2 if (twice is True or (twice == "mix" and rnd.random() < .5)) else 1
        for r in range(reps):
            if steady: s.recall("mem", b'{"user":"u2"}'); s.idle(interval // 4)
            s.recall("mem", flt); s.idle(interval // 4)
    secs = (CLOCK["ns"] - t0) / 1e9
    rep = s.report(); rep["secs"] = round(secs, 2); rep["starts/s"] = round(rep["starts"] / secs, 1)
    return rep
for interval in (4*MS, 20*MS, 100*MS, 400*MS):
    for twice in (False, "mix", True):
        print(interval//MS, "ms", twice, "\n  old", stream(True, interval, twice), "\n  new", stream(False, interval, twice))
