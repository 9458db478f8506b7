# ruff: noqa  (a review's model of the dispatcher's start policy, session 51: run from this folder with PYTHONPATH=.:../../../../tests:../../../.. python s1.py)
from sim import *
def store(users, n, old, order="random", pause=2*MS, think=2*MS, seed=0):
    s = Sim(old=old, users=users)
    rnd = random.Random(seed)
    for j in range(n):
        u = rnd.randrange(users) if order == "random" else j % users
        s.write(); s.idle(pause)
        s.recall("mem", b'{"user":"u%d"}' % u)
        s.idle(think)
    return s.report()
for users in (3, 6, 7, 8, 9, 12, 20):
    for order in ("random", "turn"):
        print(users, order, "old", store(users, 600, True, order), "\n       new", store(users, 600, False, order))
