"""A fully cached rerun costs the same for 100 MB and 5 GB of artefacts, locally and on S3.

Two steps, `blob` (`--sizes` bytes in files of at most `--file-size`, or `--s3-file-size` on S3)
and `reader` (its input), are computed once into a store, then rerun `--rounds` times: every step
a cache hit, each rerun timed from a fresh local cache (KILN_CACHE), as on a machine that never
ran them. Two stores: a local folder (the files sparse, so 5 GB costs no disk write) and `s3://`
on a moto server on 127.0.0.1 (the files uploaded once). moto assembles a multipart upload in
memory, several copies over (one 5 GB file took all 24 GiB of the machine it was tried on), so on
S3 the bytes go in files of 64 MiB by default, as a tokenized corpus's shards would. For each
store it prints the median rerun time per size, the ratio of the largest size to the smallest
(the issue's goal: under 1.2), and how many GET requests the S3 server logged for the blob's data
files during the reruns (goal: none; a cache hit lists and reads lineage.json).

    uv run --dev python benchmarks/cache_hit_bench.py --sizes 100M 5G --s3-sizes 100M 5G --rounds 3
"""

from __future__ import annotations

import argparse
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
from tests.conftest import moto_server  # noqa: E402

BLOB = "data-"  # the blob step's data files: data-00000.bin, data-00001.bin, ...


class BlobConfig(ConfigModel):
    size_bytes: int
    file_bytes: int


def write_blob(ctx) -> dict:
    """size_bytes in files of at most file_bytes, sparse (truncate): on a local store they stay
    sparse, on a remote one publishing uploads them whole."""
    size, per_file = ctx.config.size_bytes, ctx.config.file_bytes
    for i, start in enumerate(range(0, size, per_file)):
        with open(ctx.out / f"{BLOB}{i:05d}.bin", "wb") as f:
            f.truncate(min(per_file, size - start))
    return {"bytes": size, "files": -(-size // per_file)}


def read_nothing(ctx) -> dict:
    return {"input": sorted(ctx.inputs)}


def steps_of(size: int, file_bytes: int) -> list[Step]:
    blob = Step("blob", "blob", 1, BlobConfig(size_bytes=size, file_bytes=file_bytes), write_blob)
    return [blob, Step("reader", "reader", 1, BlobConfig(size_bytes=0, file_bytes=1), read_nothing,
                       inputs={"blob": blob})]


@flow(name="cache-hit-bench")
def run_steps(steps: list, root: str) -> list:
    return execute(steps, Store(root))


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def first_run(root: str, size: int, file_bytes: int, scratch: Path) -> float:
    """Compute both steps into the store (on S3 this uploads the blob); its wall time."""
    os.environ["KILN_CACHE"] = str(scratch / f"cache-first-{size}")
    start = time.perf_counter()
    first = run_steps(steps_of(size, file_bytes), root)
    if [r.status for r in first] != ["ran", "ran"]:
        raise RuntimeError(f"the first run of {root} did not compute both steps: {[r.status for r in first]}")
    return time.perf_counter() - start


def reruns(root: str, size: int, file_bytes: int, rounds: int, scratch: Path) -> list[float]:
    steps = steps_of(size, file_bytes)
    times = []
    for i in range(rounds):
        os.environ["KILN_CACHE"] = str(scratch / f"cache-{size}-{i}")  # a machine that never ran them
        start = time.perf_counter()
        runs = run_steps(steps, root)
        times.append(time.perf_counter() - start)
        if [r.status for r in runs] != ["cached", "cached"]:
            raise RuntimeError(f"rerun {i + 1} on {root} was not all cache hits: {[r.status for r in runs]}")
    return times


def gets_of(log: Path, since: int, name: str) -> int:
    """GET requests for keys whose name starts with `name` that the server logged after byte
    `since` of its log."""
    with open(log, "rb") as f:
        f.seek(since)
        return sum(1 for line in f if b'"GET ' in line and f"/{name}".encode() in line)


def report(where: str, sizes: list[int], medians: dict[int, float]) -> None:
    for size in sizes:
        print(f"{where}: {size / (1 << 20):>8.0f} MiB stored: cached rerun median {medians[size]:.2f} s")
    ratio = medians[sizes[-1]] / medians[sizes[0]]
    print(f"{where}: ratio {sizes[-1] >> 20} MiB / {sizes[0] >> 20} MiB = {ratio:.2f} (goal < 1.2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["100M", "5G"], help="stored sizes, local store")
    parser.add_argument("--s3-sizes", nargs="+", default=["100M", "5G"], help="stored sizes, S3 store")
    parser.add_argument("--file-size", default="5G", help="the largest data file, local store")
    parser.add_argument("--s3-file-size", default="64M",
                        help="the largest data file, S3 store (moto assembles a multipart upload in memory)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["local", "s3"], help="one store kind only")
    args = parser.parse_args()
    sizes = sorted(parse_size(s) for s in args.sizes)
    s3_sizes = sorted(parse_size(s) for s in args.s3_sizes)
    file_bytes, s3_file_bytes = parse_size(args.file_size), parse_size(args.s3_file_size)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory(prefix="kcache-") as tmp, prefect_test_harness(server_startup_timeout=120):
        scratch = Path(tmp)
        if args.only in (None, "local"):
            medians = {}
            for size in sizes:
                first_run(str(scratch / f"local-{size}"), size, file_bytes, scratch)
                times = reruns(str(scratch / f"local-{size}"), size, file_bytes, args.rounds, scratch)
                medians[size] = statistics.median(times)
                print(f"local {size >> 20} MiB: reruns {', '.join(f'{t:.2f}' for t in times)} s", flush=True)
            report("local", sizes, medians)
        if args.only in (None, "s3"):
            import s3fs

            log = scratch / "moto.log"
            with moto_server(log) as endpoint:
                os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                                   "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint})
                s3fs.S3FileSystem(endpoint_url=endpoint, key="bench", secret="bench").mkdir("kiln")
                s3fs.S3FileSystem.clear_instance_cache()
                medians, gets = {}, {}
                for size in s3_sizes:
                    upload = first_run(f"s3://kiln/store-{size}", size, s3_file_bytes, scratch)
                    print(f"s3 {size >> 20} MiB: first run (its upload of {-(-size // s3_file_bytes)} files) "
                          f"{upload:.1f} s", flush=True)
                    since = log.stat().st_size
                    times = reruns(f"s3://kiln/store-{size}", size, s3_file_bytes, args.rounds, scratch)
                    medians[size], gets[size] = statistics.median(times), gets_of(log, since, BLOB)
                    print(f"s3 {size >> 20} MiB: reruns {', '.join(f'{t:.2f}' for t in times)} s; GETs during "
                          f"them: {gets[size]} of {BLOB}*, {gets_of(log, since, 'lineage.json')} of lineage.json",
                          flush=True)
                report("s3", s3_sizes, medians)
                # The control: one read of a data file, which the count must see.
                since = log.stat().st_size
                fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="bench", secret="bench")
                fs.read_block(next(p for p in fs.find("kiln") if f"/{BLOB}" in p), 0, 1024)
                print(f"s3: control, one read of a data file: {gets_of(log, since, BLOB)} GET(s) of {BLOB}* counted")
                total = sum(1 for line in log.read_bytes().splitlines() if b'"GET ' in line)
                print(f"s3: GET requests logged in all (listings, lineage, first runs): {total}; of {BLOB}* in "
                      f"the reruns: {sum(gets.values())} (goal 0)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
