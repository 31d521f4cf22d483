"""Host memory of zstd shards under a global shuffle: each process's RSS stays under the frame
cache bound, whatever the size of the split (measured in a fresh process: /proc peak RSS)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.training_runs import REPO
from trainer.data import METADATA_NAME, _write_shards
from trainer.rundir import read_json

SPLIT_BYTES = 48 << 20  # decompressed size of the split
CACHE_BYTES = 4 << 20
SAMPLE_LEN = 1024  # seq_len 1023, uint16: 2 KiB per sample, 32 samples per 64 KiB frame

# Runs in a fresh interpreter: read every sample once in the trainer's global order and print
# how far the peak RSS rose above what it was before the first sample.
READER = """
import sys
from pathlib import Path
from trainer.data import GlobalSampler, TokenDataset

def kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])

ds = TokenDataset(Path(sys.argv[1]), "train", cache_bytes=int(sys.argv[2]))
order = GlobalSampler(len(ds), seed=0).permutation(0).tolist()
ds[order[0]]
Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS to the current RSS
before = kib("VmRSS:")
total = 0
for index in order:
    total += int(ds[index][0])
print((kib("VmHWM:") - before) * 1024)
"""


@pytest.fixture(scope="module")
def zstd_split(prepared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared-dataset directory whose train split is 48 MiB of zstd shards (random tokens)."""
    out = tmp_path_factory.mktemp("zstd") / "data"
    out.mkdir()
    metadata = read_json(prepared_data / METADATA_NAME)
    samples = np.random.default_rng(0).integers(
        0, metadata["vocab_size"], (SPLIT_BYTES // (2 * SAMPLE_LEN), SAMPLE_LEN), dtype=np.uint16
    )
    shards = _write_shards(out, "train", samples, 8 << 20, zstd=True)
    metadata.update(seq_len=SAMPLE_LEN - 1, sample_len=SAMPLE_LEN, dtype="uint16")
    metadata.update(compression="zstd", splits={"train": {"shards": shards}})
    (out / METADATA_NAME).write_text(json.dumps(metadata))
    return out


def peak_rss_growth(data: Path, cache_bytes: int) -> int:
    result = subprocess.run(
        [sys.executable, "-c", READER, str(data), str(cache_bytes)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split()[-1])


@pytest.mark.integration
def test_rss_under_a_global_shuffle_stays_under_the_cache_bound(zstd_split: Path) -> None:
    # The bound: the cache, one frame being decompressed, and allocator slack.
    bound = CACHE_BYTES + (8 << 20)
    bounded = peak_rss_growth(zstd_split, CACHE_BYTES)
    print(f"peak RSS growth: {bounded / 2**20:.1f} MiB with a {CACHE_BYTES >> 20} MiB cache")
    assert bounded < bound, bounded
    # The measurement sees the memory: with an unbounded cache the process ends up holding the
    # whole split, as every process did before the cache existed.
    unbounded = peak_rss_growth(zstd_split, 1 << 40)
    print(f"peak RSS growth: {unbounded / 2**20:.1f} MiB unbounded")
    assert unbounded > 0.8 * SPLIT_BYTES, unbounded
