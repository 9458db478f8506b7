"""Bodies of forked worker processes (run through ``_harness.fork_worker``)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kalos_retrievers import KalosClient, KalosError

from ._harness import Counters

# counter layout of an honest client: base + one of these
OK, ERR, WRONG, LAST_OK_NS, STOP = 0, 1, 2, 3, 4
HONEST_STRIDE = 8


def dataset(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """The rows every honest client can verify: id str(i) has vector data[i]."""
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def load_dataset(client: KalosClient, n: int, dim: int, namespace: str = "") -> np.ndarray:
    data = dataset(n, dim)
    client.upsert([str(i) for i in range(n)], data, texts=[f"text {i}" for i in range(n)],
                  namespace=namespace)  # fmt: skip
    return data


def honest_recaller(name: str, dim: int, n: int, counters: Counters, base: int, seed: int,
                    stop_index: int, timeout: float = 5.0) -> dict[str, Any]:  # fmt: skip
    """Recall stored rows by their own vector until told to stop; count answers, errors and
    wrong answers (a misrouted or corrupted response), and stamp the last success."""
    data = dataset(n, dim)
    rng = np.random.default_rng(seed)
    errors: list[str] = []
    with KalosClient(name, dim=dim, spin_us=0, timeout=timeout, max_slots=1) as c:
        while not counters[stop_index]:
            i = int(rng.integers(n))
            try:
                r = c.recall(data[i], k=1)
                good = r.ids[0] == str(i)
            except KalosError as e:
                counters.add(base + ERR)
                if len(errors) < 20:
                    errors.append(repr(e))
                continue
            if good:
                counters.add(base + OK)
                counters[base + LAST_OK_NS] = time.monotonic_ns()
            else:
                counters.add(base + WRONG)
    return {"errors": errors}


def kill_victim(name: str, dim: int, n: int, seed: int, ready_fd: int) -> None:
    """A client that connects, says so on ``ready_fd``, then issues every kind of request back
    to back until it is killed (so a SIGKILL lands at a random point of some request)."""
    import os

    rng = np.random.default_rng(seed)
    data = dataset(n, dim)
    spin = float(rng.choice([0.0, 300.0]))
    c = KalosClient(name, dim=dim, spin_us=spin, timeout=5.0, max_slots=2)
    c.ping()
    os.write(ready_fd, b"x")
    os.close(ready_fd)
    ns, k = f"victim{seed}", 0
    while True:
        op = int(rng.integers(7))
        if op == 0:
            c.recall(data[int(rng.integers(n))], k=int(rng.integers(1, 20)))
        elif op == 1:
            c.upsert([f"x{k}"], rng.standard_normal((1, dim)), texts=["t"], namespace=ns)
            k += 1
        elif op == 2:
            c.get([str(int(rng.integers(n)))])
        elif op == 3:
            c.count()
        elif op == 4:
            c.delete([f"x{int(rng.integers(max(k, 1)))}"], namespace=ns)
        elif op == 5:
            c.recall_batch(data[: int(rng.integers(1, 8))], k=5)
        else:
            c.scan(namespace=ns, limit=5)


def degrading_caller(name: str, dim: int, n: int, counters: Counters, base: int, stop_index: int,
                     timeout: float, seed: int, on_error: str = "empty") -> dict[str, Any]:  # fmt: skip
    """A retriever as the adapters build it: KalosClient behind a Degrader. Each call's
    duration is measured; a transient error becomes empty context, anything else escapes."""
    from kalos_retrievers import Degrader

    data = dataset(n, dim)
    rng = np.random.default_rng(seed)
    degrader = Degrader(f"caller{base}", on_error)  # type: ignore[arg-type]
    c = KalosClient(name, dim=dim, spin_us=0, timeout=timeout, lazy=True)
    ok_us: list[int] = []
    degraded: list[tuple[int, int, str]] = []  # (start ns, duration us, error class)
    escaped: list[str] = []
    while not counters[stop_index]:
        q = data[int(rng.integers(n))]
        t0 = time.monotonic_ns()
        try:
            c.recall(q, k=3)
        except Exception as e:
            dt = (time.monotonic_ns() - t0) // 1000
            if degrader.should_degrade(e):
                degraded.append((t0, dt, type(e).__name__))
                counters.add(base + ERR)
            else:
                escaped.append(repr(e))
                counters.add(base + WRONG)
            continue
        degrader.succeeded()
        ok_us.append((time.monotonic_ns() - t0) // 1000)
        counters.add(base + OK)
        counters[base + LAST_OK_NS] = time.monotonic_ns()
    c.close()
    return {"ok_us": ok_us, "degraded": degraded, "escaped": escaped[:5], "n_escaped": len(escaped),
            "episodes": degrader.episodes, "degraded_calls": degrader.degraded_calls}  # fmt: skip


def version_vector(id_: str, version: str, dim: int) -> np.ndarray:
    """The vector written for ``id_`` at ``version`` (deterministic, never zero)."""
    import zlib

    v = np.random.default_rng(zlib.crc32(f"{id_}|{version}".encode())).standard_normal(dim)
    return v.astype(np.float32)


def durable_writer(name: str, dim: int, wid: int, ids: list[str], rnd: int, seed: int,
                   counters: Counters, stop_index: int) -> dict[str, Any]:  # fmt: skip
    """Upsert and delete batches of ``ids`` until the sidecar goes away (or told to stop).

    Returns the op log: each op with ``ack`` True when the call returned (acknowledged), False
    for the one in flight when the sidecar died (unacknowledged: it may or may not have
    landed). After every acknowledged upsert the writer reads its ids back (read-your-writes).
    """
    rng = np.random.default_rng(seed)
    log: list[dict[str, Any]] = []
    ryw_checked, ryw_bad = 0, []
    try:
        c = KalosClient(name, dim=dim, spin_us=0, timeout=10.0)
    except KalosError as e:
        return {"log": log, "ryw_checked": 0, "ryw_bad": [], "connect_error": repr(e)}
    seq = 0
    while not counters[stop_index]:
        seq += 1
        version = f"{rnd}.{wid}.{seq}"
        batch = [str(x) for x in rng.choice(ids, size=int(rng.integers(1, 5)), replace=False)]
        upsert = bool(rng.random() < 0.6)
        entry = {"op": "upsert" if upsert else "delete", "ids": batch, "version": version,
                 "ack": False}  # fmt: skip
        log.append(entry)
        try:
            if upsert:
                c.upsert(batch, np.stack([version_vector(i, version, dim) for i in batch]),
                         texts=[f"{i}|{version}" for i in batch],
                         metadatas=[{"v": version} for _ in batch])  # fmt: skip
            else:
                c.delete(batch)
        except KalosError as e:
            entry["error"] = repr(e)
            break
        entry["ack"] = True
        counters.add(wid)
        if upsert:
            try:
                got = {r.id: r.text for r in c.get(batch)}
            except KalosError:
                break  # killed right after the ack: nothing to check
            ryw_checked += 1
            want = {i: f"{i}|{version}" for i in batch}
            if got != want:
                ryw_bad.append({"want": want, "got": got})
    c.close()
    return {"log": log, "ryw_checked": ryw_checked, "ryw_bad": ryw_bad[:5]}


def honest_writer(name: str, dim: int, counters: Counters, base: int, stop_index: int,
                  seed: int) -> dict[str, Any]:  # fmt: skip
    """Upsert, read back (read-your-writes), recall and delete in namespace "honest" until told to
    stop; count successes, errors and wrong answers."""
    rng = np.random.default_rng(seed)
    errors: list[str] = []
    seq = 0
    with KalosClient(name, dim=dim, spin_us=0, timeout=5.0, max_slots=1) as c:
        while not counters[stop_index]:
            seq += 1
            id_ = f"h{seq % 50}"
            vec = rng.standard_normal(dim).astype(np.float32)
            try:
                c.upsert([id_], vec[None], texts=[f"v{seq}"], namespace="honest")
                got = c.get([id_], namespace="honest", with_vectors=True)
                hit = c.recall(vec, k=1, namespace="honest")
                ok = (len(got) == 1 and got[0].text == f"v{seq}" and hit.ids == [id_]
                      and np.allclose(got[0].vector, vec / np.linalg.norm(vec), atol=1e-5))  # fmt: skip
                if seq % 7 == 0:
                    c.delete([id_], namespace="honest")
            except KalosError as e:
                counters.add(base + ERR)
                if len(errors) < 20:
                    errors.append(repr(e))
                continue
            if ok:
                counters.add(base + OK)
                counters[base + LAST_OK_NS] = time.monotonic_ns()
            else:
                counters.add(base + WRONG)
    return {"errors": errors}


def mixed_client(name: str, dim: int, n: int, wid: int, counters: Counters, base: int,
                 stop_index: int, seed: int) -> dict[str, Any]:  # fmt: skip
    """Soak load: recalls (checked), upserts, gets, deletes and counts in a namespace of its
    own, on a bounded set of ids (so the sidecar's size plateaus), until told to stop."""
    rng = np.random.default_rng(seed)
    data = dataset(n, dim)
    ns = f"soak{wid}"
    errors: list[str] = []
    with KalosClient(name, dim=dim, spin_us=0, timeout=10.0) as c:
        while not counters[stop_index]:
            op = int(rng.integers(10))
            try:
                if op < 5:
                    i = int(rng.integers(n))
                    good = c.recall(data[i], k=3).ids[0] == str(i)
                elif op < 7:
                    ids = [f"s{int(x)}" for x in rng.integers(0, 30, size=int(rng.integers(1, 4)))]
                    c.upsert(ids, rng.standard_normal((len(ids), dim)), texts=["soak"] * len(ids),
                             metadatas=[{"w": wid}] * len(ids), namespace=ns)  # fmt: skip
                    good = True
                elif op == 7:
                    c.get([f"s{int(rng.integers(30))}"], namespace=ns)
                    good = True
                elif op == 8:
                    c.delete([f"s{int(rng.integers(30))}"], namespace=ns)
                    good = True
                else:
                    good = c.count(namespace=ns, filter={"w": wid}) <= 30
            except KalosError as e:
                counters.add(base + ERR)
                if len(errors) < 10:
                    errors.append(repr(e))
                continue
            counters.add(base + (OK if good else WRONG))
    return {"errors": errors}


def connect_cycles(name: str, dim: int, n: int, cycles: int, seed: int,
                   timeout: float = 5.0) -> dict[str, Any]:  # fmt: skip
    """``cycles`` times: connect, recall (checked), close. Samples this process's open fds and
    RSS after the first tenth of the cycles and at the end."""
    import os

    from ._harness import proc_fds, proc_rss_kb

    rng = np.random.default_rng(seed)
    data = dataset(n, dim)
    errors: list[str] = []
    n_errors = wrong = 0
    base_fds = base_rss = None
    for j in range(cycles):
        if j == max(1, cycles // 10):
            base_fds, base_rss = proc_fds(os.getpid()), proc_rss_kb(os.getpid())
        try:
            c = KalosClient(name, dim=dim, spin_us=0, timeout=timeout)
            try:
                i = int(rng.integers(n))
                wrong += c.recall(data[i], k=1).ids[0] != str(i)
            finally:
                c.close()
        except KalosError as e:
            n_errors += 1
            if len(errors) < 10:
                errors.append(repr(e))
    return {"errors": errors, "n_errors": n_errors, "wrong": wrong, "fds": (base_fds, proc_fds(os.getpid())),
            "rss_kb": (base_rss, proc_rss_kb(os.getpid()))}  # fmt: skip
