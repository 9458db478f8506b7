"""One line per doorbell_probe.py JSON line in the files given: rows, scan + merge p50, the
round trip's p50 and p99, top-1 wrong."""

import json
import sys
from pathlib import Path

for f in sys.argv[1:]:
    for line in Path(f).read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        if "modes" not in r:
            continue
        for m in r["modes"].values():
            k, rt = m["kernel_us"], m["roundtrip_us"]
            print(f"{f.split('/')[-1]:<22} rows={r['rows']:>8} {r['dtype']} scan+merge {k['scan_merge']['p50']:7.1f}"
                  f" prep {k['prep']['p50']:4.1f} respond {k['respond']['p50']:4.1f}"
                  f" rt {rt['p50']:7.1f} / {rt['p99']:7.1f} wrong {m['top1_wrong']}"
                  f" graph {r['graph_search_slots_us']['p50']}")
