"""Fixtures shared by the trainer tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainer.data import prepare


@pytest.fixture(scope="session")
def prepared_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default corpus prepared once per session: vocab 4096, seq_len 64.

    Read-only for tests: prepare a private copy with `trainer.data.prepare` to modify one.
    """
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare(out, seq_len=64, vocab_size=4096)
    return out


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors on a shared 2-core box: a second intra-op thread only adds barrier waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
