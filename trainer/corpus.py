"""Raw text in, clean unique documents out: the first half of `trainer.data.prepare`.

Document rules (docs/data.md explains why):

- a `.jsonl` file holds one document per line, in its "text" field;
- any other file given on the command line, and every `.txt` file found under a directory given on
  the command line, is one document;
- with no inputs, the documentation topics that ship with CPython (`pydoc_data.topics`) are the
  corpus, so the demo and the tests never download anything.

Cleaning is NFC normalisation, `\\r\\n`/`\\r` → `\\n`, and removal of control characters other
than newline and tab. Documents that are empty after cleaning are dropped, and exact duplicates
(same sha256 of the cleaned text) are kept once.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from trainer.errors import DataError

DEFAULT_CORPUS_NAME = "pydoc_data.topics"
NORMALIZATION: Final = "NFC"
DIRECTORY_SUFFIXES = (".txt", ".jsonl")

# Cc minus \t and \n; \r is folded into \n before this runs.
_CONTROL_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass(frozen=True)
class SourceFile:
    """One input file as read: its name for messages and metadata, and a digest of its bytes."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Document:
    text: str
    digest: bytes  # sha256 of the cleaned text: the dedup key and the split key


@dataclass
class CorpusStats:
    read: int = 0
    empty: int = 0
    duplicates: int = 0
    kept: int = 0
    characters: int = 0
    control_chars_removed: int = 0
    changed_by_normalization: int = 0


@dataclass
class Corpus:
    documents: list[Document] = field(default_factory=list)
    sources: list[SourceFile] = field(default_factory=list)
    stats: CorpusStats = field(default_factory=CorpusStats)


def clean_text(text: str) -> tuple[str, int, bool]:
    """The cleaned text, how many control characters it lost, and whether NFC changed it."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text, removed = _CONTROL_RE.subn("", text)
    normalized = unicodedata.normalize(NORMALIZATION, text)
    return normalized, removed, normalized != text


def read_corpus(inputs: Sequence[str | Path]) -> Corpus:
    corpus = Corpus()
    seen: set[bytes] = set()
    stats = corpus.stats
    for raw in _raw_documents(inputs, corpus.sources):
        stats.read += 1
        text, removed, renormalized = clean_text(raw)
        stats.control_chars_removed += removed
        stats.changed_by_normalization += renormalized
        if not text.strip():
            stats.empty += 1
            continue
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        if digest in seen:
            stats.duplicates += 1
            continue
        seen.add(digest)
        corpus.documents.append(Document(text, digest))
        stats.kept += 1
        stats.characters += len(text)
    return corpus


def _raw_documents(inputs: Sequence[str | Path], sources: list[SourceFile]) -> Iterator[str]:
    if not inputs:
        yield from _default_corpus(sources)
        return
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files = sorted(
                p for p in path.rglob("*") if p.is_file() and p.suffix in DIRECTORY_SUFFIXES
            )
            if not files:
                raise DataError(
                    f"{path} holds no .txt or .jsonl files; put one document per .txt file "
                    "or one JSON object with a 'text' field per line of a .jsonl file"
                )
        elif path.is_file():
            files = [path]
        else:
            raise DataError(f"input {path} does not exist; pass existing .txt/.jsonl files or dirs")
        for file in files:
            yield from _read_file(file, sources)


def _read_file(path: Path, sources: list[SourceFile]) -> Iterator[str]:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DataError(f"cannot read {path}: {error.strerror}; check its permissions") from None
    sources.append(SourceFile(str(path), len(data), hashlib.sha256(data).hexdigest()))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(
            f"{path} is not UTF-8 (bad byte at offset {error.start}); convert it, "
            "e.g. iconv -f latin1 -t utf-8"
        ) from None
    if path.suffix != ".jsonl":
        yield text
        return
    # Not splitlines(): it would also split at U+2028 and friends, which JSON allows raw in strings.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{number} is not valid JSON ({error.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}:{number} has no string "text" field; one object per line')
        yield record["text"]


def _default_corpus(sources: list[SourceFile]) -> Iterator[str]:
    from pydoc_data.topics import topics

    texts = [topics[key] for key in sorted(topics)]
    digest = hashlib.sha256()
    for text in texts:
        digest.update(hashlib.sha256(text.encode("utf-8")).digest())
    size = sum(len(text.encode("utf-8")) for text in texts)
    sources.append(SourceFile(DEFAULT_CORPUS_NAME, size, digest.hexdigest()))
    yield from texts
