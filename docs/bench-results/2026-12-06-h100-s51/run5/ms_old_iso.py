# ruff: noqa  (a record of the script as it ran on the device)
# memory_search with KalosMemory's _iso uncached (its lru_cache's __wrapped__): the A/B of e63377c in one lease
import runpy, sys
import kalos_retrievers.memory as mm
mm._iso = mm._iso.__wrapped__
sys.argv = ["memory_search.py", *sys.argv[1:]]
runpy.run_path("benchmarks/memory_search.py", run_name="__main__")
