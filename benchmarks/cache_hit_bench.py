"""A fully cached rerun costs the same for 100 MB and 5 GB of artefacts, locally and on S3.

Two steps, `blob` (one file of `--sizes` bytes) and `reader` (its input), are computed once into a
store, then rerun `--rounds` times: every step a cache hit, each rerun timed from a fresh local
cache (KILN_CACHE), as on a machine that never ran them. Two stores: a local folder (the blob
sparse, so 5 GB costs no disk write) and `s3://` on an S3 server on 127.0.0.1 (the blob uploaded
once, whole). The server is moto by default, which holds uploads in memory (100 MB and 1 GB then),
or with `--s3-server s3rver` the npm package s3rver (`npm install --prefix DIR s3rver@3.7.1`;
`--s3rver DIR/node_modules/.bin/s3rver`), which keeps objects on disk, so 5 GB fits. For each
store it prints the median rerun time per size, the ratio of the largest size to the smallest (the
issue's goal: under 1.2), and how many GET requests the S3 server logged for the blob's data file
during the reruns (goal: none; a cache hit lists and reads lineage.json).

    uv run --dev python benchmarks/cache_hit_bench.py --sizes 100M 5G --s3-sizes 100M 1G --rounds 3
    uv run --dev python benchmarks/cache_hit_bench.py --only s3 --s3-server s3rver \
        --s3rver /tmp/s3rver-bench/node_modules/.bin/s3rver --s3-sizes 100M 5G
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

from prefect import flow  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402

from tasks.engine.config import ConfigModel  # noqa: E402
from tasks.engine.scheduler import execute  # noqa: E402
from tasks.engine.step import Step  # noqa: E402
from tasks.engine.store import Store  # noqa: E402
from tests.conftest import _tcp_open, free_port, moto_server, server  # noqa: E402

BLOB = "blob.bin"
CHUNK = 64 << 20


class BlobConfig(ConfigModel):
    size_bytes: int


def write_blob(ctx) -> dict:
    """One file of size_bytes: sparse on a local store (truncate), written whole where the store is
    remote (publishing uploads it)."""
    size = ctx.config.size_bytes
    with open(ctx.out / BLOB, "wb") as f:
        f.truncate(size)
    return {"bytes": size}


def read_nothing(ctx) -> dict:
    return {"input": sorted(ctx.inputs)}


def steps_of(size: int) -> list[Step]:
    blob = Step("blob", "blob", 1, BlobConfig(size_bytes=size), write_blob)
    return [blob, Step("reader", "reader", 1, BlobConfig(size_bytes=0), read_nothing, inputs={"blob": blob})]


@flow(name="cache-hit-bench")
def run_steps(steps: list, root: str) -> list:
    return execute(steps, Store(root))


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def first_run(root: str, size: int, scratch: Path) -> float:
    """Compute both steps into the store (on S3 this uploads the blob); its wall time."""
    os.environ["KILN_CACHE"] = str(scratch / f"cache-first-{size}")
    start = time.perf_counter()
    first = run_steps(steps_of(size), root)
    if [r.status for r in first] != ["ran", "ran"]:
        raise RuntimeError(f"the first run of {root} did not compute both steps: {[r.status for r in first]}")
    return time.perf_counter() - start


def reruns(root: str, size: int, rounds: int, scratch: Path) -> list[float]:
    steps = steps_of(size)
    times = []
    for i in range(rounds):
        os.environ["KILN_CACHE"] = str(scratch / f"cache-{size}-{i}")  # a machine that never ran them
        start = time.perf_counter()
        runs = run_steps(steps, root)
        times.append(time.perf_counter() - start)
        if [r.status for r in runs] != ["cached", "cached"]:
            raise RuntimeError(f"rerun {i + 1} on {root} was not all cache hits: {[r.status for r in runs]}")
    return times


@contextlib.contextmanager
def s3rver(exe: str, folder: Path, log: Path):
    """s3rver on a free port of 127.0.0.1, its objects under `folder` (on disk, not in memory);
    yields its endpoint. It logs one line per request (`... GET /bucket/key ...`) to `log`."""
    port = free_port()
    with server("s3rver", [exe, "-d", str(folder), "-a", "127.0.0.1", "-p", str(port)], log,
                lambda: _tcp_open("127.0.0.1", port), grace_s=10):
        yield f"http://127.0.0.1:{port}"


def gets_of(log: Path, since: int, name: str) -> int:
    """GET requests for keys ending in `name` that the server logged after byte `since` of its log
    (moto writes `"GET /kiln/...`, s3rver `GET /kiln/...`)."""
    with open(log, "rb") as f:
        f.seek(since)
        return sum(1 for line in f if b"GET /" in line and f"/{name}".encode() in line)


def report(where: str, sizes: list[int], medians: dict[int, float]) -> None:
    for size in sizes:
        print(f"{where}: {size / (1 << 20):>8.0f} MiB stored: cached rerun median {medians[size]:.2f} s")
    ratio = medians[sizes[-1]] / medians[sizes[0]]
    print(f"{where}: ratio {sizes[-1] >> 20} MiB / {sizes[0] >> 20} MiB = {ratio:.2f} (goal < 1.2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["100M", "5G"], help="stored sizes, local store")
    parser.add_argument("--s3-sizes", nargs="+", default=["100M", "1G"],
                        help="stored sizes, S3 store (moto keeps an upload in memory, several times over: a 5 GB "
                        "multipart upload took all 24 GiB of the machine it was tried on)")
    parser.add_argument("--s3-server", choices=["moto", "s3rver"], default="moto",
                        help="the S3 server on loopback: moto (in memory) or s3rver (objects on disk)")
    parser.add_argument("--s3rver", default="s3rver", help="the s3rver executable, for --s3-server s3rver")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["local", "s3"], help="one store kind only")
    args = parser.parse_args()
    sizes = sorted(parse_size(s) for s in args.sizes)
    s3_sizes = sorted(parse_size(s) for s in args.s3_sizes)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="kcache-") as tmp, prefect_test_harness(server_startup_timeout=120):
        scratch = Path(tmp)
        if args.only in (None, "local"):
            medians = {}
            for size in sizes:
                first_run(str(scratch / f"local-{size}"), size, scratch)
                times = reruns(str(scratch / f"local-{size}"), size, args.rounds, scratch)
                medians[size] = statistics.median(times)
                print(f"local {size >> 20} MiB: reruns {', '.join(f'{t:.2f}' for t in times)} s", flush=True)
            report("local", sizes, medians)
        if args.only in (None, "s3"):
            import s3fs

            log = scratch / f"{args.s3_server}.log"
            started = moto_server(log) if args.s3_server == "moto" else s3rver(args.s3rver, scratch / "s3rver", log)
            with started as endpoint:
                os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                                   "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint})
                s3fs.S3FileSystem(endpoint_url=endpoint, key="bench", secret="bench").mkdir("kiln")
                s3fs.S3FileSystem.clear_instance_cache()
                medians, gets = {}, {}
                for size in s3_sizes:
                    upload = first_run(f"s3://kiln/store-{size}", size, scratch)
                    print(f"s3 {size >> 20} MiB: first run (its upload) {upload:.1f} s", flush=True)
                    since = log.stat().st_size
                    times = reruns(f"s3://kiln/store-{size}", size, args.rounds, scratch)
                    medians[size], gets[size] = statistics.median(times), gets_of(log, since, BLOB)
                    print(f"s3 {size >> 20} MiB: reruns {', '.join(f'{t:.2f}' for t in times)} s; GETs during "
                          f"them: {gets[size]} of {BLOB}, {gets_of(log, since, 'lineage.json')} of lineage.json",
                          flush=True)
                report(f"s3 ({args.s3_server})", s3_sizes, medians)
                total = sum(1 for line in log.read_bytes().splitlines() if b"GET /" in line)
                print(f"s3: GET requests logged in all (listings, lineage, first runs): {total}; of {BLOB} in "
                      f"the reruns: {sum(gets.values())} (goal 0)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
