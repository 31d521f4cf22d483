"""Fixtures shared by the trainer tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.data import prepare


@pytest.fixture(scope="session")
def prepared_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default corpus prepared once per session: vocab 4096, seq_len 64.

    Read-only for tests: prepare a private copy with `trainer.data.prepare` to modify one.
    """
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare(out, seq_len=64, vocab_size=4096)
    return out
