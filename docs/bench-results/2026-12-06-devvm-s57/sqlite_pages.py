import sqlite3, os, time, sys, numpy as np, shutil
N=int(sys.argv[1]); chunk=7700
rng=np.random.default_rng(0)
vecs=rng.standard_normal((N,768)).astype('<f4')
def run(page):
    d=f"/tmp/sqlb/db_{page}"; shutil.rmtree(d,ignore_errors=True); os.makedirs(d)
    db=sqlite3.connect(d+"/x.db", isolation_level=None)
    db.execute(f"PRAGMA page_size={page}")
    db.execute("PRAGMA journal_mode=WAL"); db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE memories(ns TEXT NOT NULL, id TEXT NOT NULL, text TEXT NOT NULL, metadata BLOB NOT NULL, vector BLOB NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL, crc INTEGER NOT NULL, PRIMARY KEY (ns, id)) WITHOUT ROWID")
    tw=0
    for s in range(0,N,chunk):
        params=[("", f"doc-{i}", f"memory number {i} text", b"{}", vecs[i].tobytes(), 1.0, 1.0, 0) for i in range(s,min(N,s+chunk))]
        a=time.perf_counter()
        db.execute("BEGIN IMMEDIATE"); db.executemany("INSERT OR REPLACE INTO memories VALUES (?,?,?,?,?,?,?,?)", params); db.execute("COMMIT")
        tw+=time.perf_counter()-a
    one=[]
    for j in range(200):
        a=time.perf_counter()
        db.execute("BEGIN IMMEDIATE"); db.execute("INSERT OR REPLACE INTO memories VALUES (?,?,?,?,?,?,?,?)", ("", f"new-{j}", "x", b"{}", vecs[j].tobytes(),1.0,1.0,0)); db.execute("COMMIT")
        one.append(time.perf_counter()-a)
    t1=time.perf_counter()
    cur=db.execute("SELECT ns,id,text,metadata,vector,created_at,updated_at,crc FROM memories"); n=0
    while True:
        c=cur.fetchmany(10000)
        if not c: break
        n+=len(c)
    t2=time.perf_counter()
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    sz=os.path.getsize(d+"/x.db")
    print(f"page={page:6d} bulk {tw/N*1e6:6.1f} us/row  one-row commit p50 {np.median(one)*1e3:.2f} ms  read {(t2-t1)/N*1e6:5.1f} us/row  db {sz/2**20:.0f} MiB", flush=True)
    db.close(); shutil.rmtree(d)
for rep in range(2):
    for page in (4096, 16384, 65536):
        run(page)
