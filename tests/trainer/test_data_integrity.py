"""Shard checksums: a shard replaced by other bytes of the same size is a data error (exit 3)
naming the shard and how to re-prepare, never a traceback and never silent training on it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.training_runs import TINY, overrides, run_cli
from trainer.data import METADATA_NAME, TokenDataset
from trainer.errors import DataError


@pytest.fixture
def own_copy(prepared_data: Path, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(prepared_data, data)
    return data


def first_shard(data: Path) -> Path:
    metadata = json.loads((data / METADATA_NAME).read_text())
    return data / metadata["splits"]["train"]["shards"][0]["name"]


def replace_with_random_bytes(shard: Path) -> None:
    size = shard.stat().st_size
    shard.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())


def assert_data_error(result, shard: Path) -> None:
    assert result.returncode == 3, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert shard.name in errors[0] and "prepare" in errors[0]


@pytest.mark.integration
def test_random_bytes_of_the_same_size_are_a_data_error(own_copy: Path, tmp_path: Path) -> None:
    shard = first_shard(own_copy)
    replace_with_random_bytes(shard)
    result = run_cli("train", "--config", str(TINY), *overrides(own_copy, tmp_path / "run"))
    assert_data_error(result, shard)


@pytest.mark.integration
def test_full_verification_catches_another_valid_shard(own_copy: Path, tmp_path: Path) -> None:
    metadata = json.loads((own_copy / METADATA_NAME).read_text())
    val = own_copy / metadata["splits"]["val"]["shards"][0]["name"]
    train = first_shard(own_copy)
    # Valid token ids, same size: only the sha256 can tell.
    data = np.frombuffer(train.read_bytes(), dtype=metadata["dtype"]).copy()
    train.write_bytes(np.roll(data, 7).tobytes())
    assert val.exists()
    args = overrides(own_copy, tmp_path / "run", "data.verify=full", "train.steps=2")
    assert_data_error(run_cli("train", "--config", str(TINY), *args), train)
    with pytest.raises(DataError, match="sha256"):
        TokenDataset(own_copy, "train", verify="full")
    TokenDataset(own_copy, "train")  # sizes alone still match: the cheap check passes


@pytest.mark.integration
def test_prepare_check_verifies_every_shard(own_copy: Path) -> None:
    ok = run_cli("prepare", "--out", str(own_copy), "--check")
    assert ok.returncode == 0, ok.stderr
    assert "sha256" in ok.stdout
    shard = first_shard(own_copy)
    replace_with_random_bytes(shard)
    before = {p.name: p.read_bytes() for p in own_copy.iterdir()}
    assert_data_error(run_cli("prepare", "--out", str(own_copy), "--check"), shard)
    assert {p.name: p.read_bytes() for p in own_copy.iterdir()} == before  # nothing rewritten
