"""Read errors are errors: a truncated or corrupt gzip stream is counted as `truncated_shard`
(the data is malformed), but a shard the operating system will not read (a folder, an I/O error)
stops the stage with a message naming the file, strict or not."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest

from tasks.documents import UnreadableShard, read_documents, read_shard, shard_name, write_shard


def test_a_truncated_archive_is_counted(tmp_path):
    path = tmp_path / "shard-00000.jsonl.gz"
    data = gzip.compress(b"".join(json.dumps({"id": i, "text": f"doc {i}"}).encode() + b"\n" for i in range(500)))
    path.write_bytes(data[: len(data) // 2])
    bad = Counter()
    docs = list(read_shard(path, bad=bad))
    assert 0 < len(docs) < 500 and bad == {"truncated_shard": 1}


def test_an_io_error_stops_with_the_file_named():
    # reading /proc/self/mem at offset 0 fails with a real EIO (the page is not mapped)
    with pytest.raises(UnreadableShard, match=r"/proc/self/mem: OSError: \[Errno 5\]"):
        list(read_shard("/proc/self/mem", bad=Counter()))


def test_a_folder_in_place_of_a_shard_stops_the_reader(tmp_path):
    write_shard(tmp_path / shard_name(0), [{"id": "a", "text": "one"}])
    (tmp_path / shard_name(1)).mkdir()  # what a stage downstream of a damaged output would meet
    with pytest.raises(UnreadableShard, match=r"shard-00001\.jsonl\.gz: IsADirectoryError"):
        list(read_documents(tmp_path, bad=Counter()))
