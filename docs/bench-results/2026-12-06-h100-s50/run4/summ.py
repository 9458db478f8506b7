"""One line per doorbell_probe.py JSON line in the files given: rows, scan+merge p50, round trip p50/p99, top-1 wrong."""
import json, sys
for f in sys.argv[1:]:
    for line in open(f):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "modes" not in r:
            continue
        for mode, m in r["modes"].items():
            k = m["kernel_us"]
            print(f"{f.split('/')[-1]:<22} rows={r['rows']:>8} {r['dtype']} scan+merge {k['scan_merge']['p50']:7.1f}"
                  f" prep {k['prep']['p50']:4.1f} respond {k['respond']['p50']:4.1f} rt {m['roundtrip_us']['p50']:7.1f} / {m['roundtrip_us']['p99']:7.1f}"
                  f" wrong {m['top1_wrong']} graph {r['graph_search_slots_us']['p50']}")
