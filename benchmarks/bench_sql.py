"""PostgreSQL table -> NumPy batches: the three routes from NumPy's point of view.

Routes, each in its own fresh process (rows/s and peak RSS):
  headrace          Dataset.from_sql over ADBC: a keyed query without parameters streams through
                    ADBC's binary COPY reader (decoded to Arrow in C++), pages of page_rows rows
  psycopg-fetchmany a psycopg 3 server-side cursor, fetchmany(65536), rows -> np.array per column
  psycopg-copy      psycopg 3 COPY (FORMAT BINARY), fixed-width rows parsed with one NumPy view
Usage: HEADRACE_TEST_POSTGRES=postgresql://... python benchmarks/bench_sql.py --rows 1000000 5000000
Writes benchmarks/results/sql.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SIDES = {
    "headrace": """
import headrace as hr
ds = hr.Dataset.from_sql("SELECT * FROM TABLE", connection=URL, key="id", batch_size=65536)
rows = sum(len(b["id"]) for b in ds)""",
    "psycopg-fetchmany": """
import psycopg, numpy as np
rows = 0
with psycopg.connect(URL) as db, db.cursor(name="c") as cur:
    cur.itersize = 65536
    cur.execute("SELECT * FROM TABLE ORDER BY id")
    while True:
        chunk = cur.fetchmany(65536)
        if not chunk:
            break
        cols = [np.array(c) for c in zip(*chunk)]
        rows += len(chunk)""",
    "psycopg-copy": """
import psycopg, numpy as np
row = np.dtype([("n", ">i2"), ("l0", ">i4"), ("id", ">i8")] + sum(
    [[(f"l{i}", ">i4"), (f"c{i}", ">f8")] for i in range(1, 10)], []))
rows = 0
with psycopg.connect(URL) as db, db.cursor() as cur:
    with cur.copy("COPY (SELECT * FROM TABLE ORDER BY id) TO STDOUT (FORMAT BINARY)") as copy:
        pending = b""
        header = True
        for data in copy:
            pending += bytes(data)
            if header:
                pending = pending[19:]  # signature, flags, extension length
                header = False
            whole = len(pending) // row.itemsize
            if whole:
                view = np.frombuffer(pending[: whole * row.itemsize], dtype=row)
                if view["n"][-1] == -1:  # the trailer
                    view = view[:-1]
                cols = [view[name].astype(view.dtype[name].newbyteorder("=")) for name in ("id", *[f"c{i}" for i in range(1, 10)])]
                rows += len(view)
                pending = pending[whole * row.itemsize:]""",
}

RUNNER = """
import time, resource, json
URL = {url!r}
{imports}
start = time.perf_counter(); cpu = time.process_time()
{body}
seconds = time.perf_counter() - start
cpu = time.process_time() - cpu  # this process's threads; the server's work is not in it
print(json.dumps({{"rows": rows, "seconds": seconds, "cpu_s": cpu,
                   "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def make_table(url: str, rows: int) -> str:
    import adbc_driver_postgresql.dbapi as pg

    name = f"bench_{rows}"
    cols = ", ".join(f"c{i} double precision" for i in range(1, 10))
    values = ", ".join(f"g * {i}.5" for i in range(1, 10))
    with pg.connect(url) as db, db.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {name}")
        cur.execute(f"CREATE TABLE {name} (id bigint PRIMARY KEY, {cols})")
        cur.execute(f"INSERT INTO {name} SELECT g, {values} FROM generate_series(1, {rows}) g")
        db.commit()
    # As a table that has been around: a freshly filled one makes its first readers set
    # every row's hint bits (writing the table again) and has no planner statistics. The
    # first records (the 5M table read right after its INSERT, while this branch's tests
    # ran) put headrace at 2.7x psycopg there against 4.9x at 1M; on a vacuumed table
    # the 5M rows stream faster per row than the 1M.
    with pg.connect(url, autocommit=True) as db, db.cursor() as cur:
        cur.execute(f"VACUUM ANALYZE {name}")
    return name


def drop_table(url: str, name: str) -> None:
    import adbc_driver_postgresql.dbapi as pg

    with pg.connect(url) as db, db.cursor() as cur:
        cur.execute(f"DROP TABLE {name}")
        db.commit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 5_000_000])
    parser.add_argument("--sides", default=",".join(SIDES),
                        help="routes to run (psycopg-copy takes minutes at 5M rows)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each route, interleaved; the median is reported")
    args = parser.parse_args(argv)
    url = os.environ["HEADRACE_TEST_POSTGRES"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    load_before = os.getloadavg()[0]
    lines = ["| rows | route | M rows/s (median) | runs | client CPU s (median) | peak RSS (MiB) |",
             "|---|---|---|---|---|---|"]
    sides = {side: SIDES[side] for side in args.sides.split(",")}
    ratios = []
    for count in args.rows:
        table = make_table(url, count)
        runs: dict[str, list[dict[str, float]]] = {}
        for _ in range(args.repeats):  # interleaved: a burst of load hits every route alike
            for side, body in sides.items():
                imports, _, rest = body.strip().partition("\n")
                code = RUNNER.format(url=url, imports=imports, body=rest.replace("TABLE", table))
                out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                     text=True, env=env, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                assert r["rows"] == count, (side, r)
                runs.setdefault(side, []).append(r)
                print(f"{count:,} {side}: {count / r['seconds'] / 1e6:.3f} M rows/s, "
                      f"{r['peak_rss'] / 2**20:.0f} MiB", flush=True)
        rate = {side: statistics.median(count / r["seconds"] / 1e6 for r in rs)
                for side, rs in runs.items()}
        for side, rs in runs.items():
            each = " ".join(f"{count / r['seconds'] / 1e6:.2f}" for r in rs)
            lines.append(f"| {count:,} | {side} | {rate[side]:.3f} | {each} | "
                         f"{statistics.median(r['cpu_s'] for r in rs):.2f} | "
                         f"{max(r['peak_rss'] for r in rs) / 2**20:.0f} |")
        ratios.append(f"{count:,} rows: headrace {rate['headrace'] / rate['psycopg-fetchmany']:.1f}x "
                      "psycopg fetchmany (target >= 3x)")
        drop_table(url, table)
    lines = ["# PostgreSQL table (id + 9 float8 columns) -> NumPy batches", "",
             f"Machine: {os.cpu_count()} cores; server on loopback; each route in its own "
             f"process, {args.repeats} interleaved runs; load average {load_before:.1f} before, "
             f"{os.getloadavg()[0]:.1f} after (the machine is shared); tables vacuumed and "
             "analyzed after they are filled.", "", *lines, "",
             *ratios]
    with open(os.path.join(os.path.dirname(__file__), "results", "sql.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
