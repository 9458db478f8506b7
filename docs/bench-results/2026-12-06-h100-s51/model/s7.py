# ruff: noqa  (the GPU churn test's recalls, back to back, in the review's model: PYTHONPATH=.:../../../../tests python s7.py)
from sim import *
def b2b(users, n, old, gap=100_000, seed=0):
    s = Sim(old=old, users=max(users, 12))
    rnd = random.Random(seed)
    for j in range(n):
        u = rnd.randrange(users)
        s.recall("mem", b'{"user":"u%d"}' % u)
        s.idle(gap)
    return s.report()
for users in (12, 6):
    for seed in range(5):
        print(users, seed, "old", b2b(users, 360, True, seed=seed), "\n      new", b2b(users, 360, False, seed=seed))
