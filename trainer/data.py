"""Token data: `prepare` (corpus → tokenizer → packed shards) and the global-index loader.

A prepared dataset directory holds `metadata.json`, `tokenizer.json` and one or more shards per
split (`train-00000.bin`, or `.bin.zst` when compressed). Each shard is a row-major array of
samples of `seq_len + 1` token ids; the model reads `s[:-1]` and predicts `s[1:]`.

The loader never keeps per-rank state. Training order is a pure function of one global position
(see `GlobalSampler` and `rank_positions`), so a checkpoint stores a single integer and a resume on
any number of ranks reads exactly the samples that the uninterrupted run would have read.
docs/data.md describes the formats and the reasoning.
"""

from __future__ import annotations

import bisect
import collections
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runcontract.config import DataConfig as DataConfig
from trainer.corpus import NORMALIZATION, Corpus, Document, read_corpus
from trainer.errors import ConfigError, DataError
from trainer.rundir import read_json, sha256_file, write_json_atomic

FORMAT = 1
METADATA_NAME = "metadata.json"
TOKENIZER_NAME = "tokenizer.json"
EOT_TOKEN = "<|endoftext|>"
SPLITS = ("train", "val", "test")
BYTE_ALPHABET = 256
MIN_VOCAB_SIZE = BYTE_ALPHABET + 1  # every byte plus the end-of-text token
TOP_TOKENS = 20
ZSTD_LEVEL = 3
# zstd shards are written as independent frames of about this many uncompressed bytes (at least
# one sample), so that one sample is read by decompressing one frame, not the whole shard.
ZSTD_FRAME_BYTES = 64 << 10
# Decompressed frames a TokenDataset keeps (LRU), per process; memory-mapped shards need none.
CACHE_BYTES = 64 << 20


# ------------------------------------------------------------------------------------------------
# prepare
# ------------------------------------------------------------------------------------------------


def prepare(
    out: str | Path,
    inputs: Sequence[str | Path] = (),
    *,
    seq_len: int = 128,
    vocab_size: int = 4096,
    tokenizer: str | Path | None = None,
    min_freq: int = 2,
    shard_bytes: int = 64 << 20,
    zstd: bool = False,
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
) -> dict[str, Any]:
    """Turn raw text into a prepared dataset at `out` and return its metadata.

    `inputs` are .txt/.jsonl files or directories; none means the embedded default corpus.
    `tokenizer` reuses an existing tokenizer.json (then `vocab_size` and `min_freq` are unused);
    otherwise a byte-level BPE with `vocab_size` entries is trained, merging only pairs seen at
    least `min_freq` times. Shards hold at most `shard_bytes` of uncompressed samples.
    Preparing again with the same inputs and settings leaves an identical dataset untouched.
    """
    out = Path(out)
    if isinstance(inputs, (str, Path)):  # one path, not a sequence of characters
        inputs = [inputs]
    if seq_len < 2:
        raise DataError(f"--seq-len {seq_len} is too small; use at least 2 (e.g. 128)")
    if tokenizer is None and vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"--vocab-size {vocab_size} is too small; a byte-level BPE needs at least "
            f"{MIN_VOCAB_SIZE} (256 bytes + end-of-text), e.g. 4096"
        )
    if min_freq < 0:
        raise DataError(f"--min-freq {min_freq} is negative; use 0 or more (default 2)")
    if val_fraction < 0 or test_fraction < 0 or val_fraction + test_fraction >= 1:
        raise DataError(
            f"split fractions val={val_fraction} test={test_fraction} leave no training data; "
            "use non-negative fractions that sum to less than 1"
        )
    _check_out_dir(out)

    tokenizer_text = _read_tokenizer_file(tokenizer) if tokenizer is not None else None
    corpus = read_corpus(inputs)
    if not corpus.documents:
        stats = corpus.stats
        raise DataError(
            f"no documents left after cleaning ({stats.read} read, {stats.empty} empty, "
            f"{stats.duplicates} duplicates); give inputs with some text"
        )

    settings: dict[str, Any] = {
        "format": FORMAT,
        "seq_len": seq_len,
        "shard_bytes": shard_bytes,
        "zstd": zstd,
        "val_fraction": val_fraction,
        "test_fraction": test_fraction,
        "normalization": NORMALIZATION,
        "eot_token": EOT_TOKEN,
    }
    if tokenizer_text is None:
        settings.update(vocab_size=vocab_size, min_freq=min_freq)
    else:
        settings["tokenizer_sha256"] = hashlib.sha256(tokenizer_text.encode("utf-8")).hexdigest()
    fingerprint = _fingerprint(settings, corpus)

    existing = read_json(out / METADATA_NAME)
    if isinstance(existing, dict) and existing.get("fingerprint") == fingerprint:
        try:
            for split in SPLITS:
                TokenDataset(out, split, allow_empty=True)
            return existing
        except DataError:
            pass  # damaged: rebuild it below

    tok = _load_or_train_tokenizer(tokenizer_text, corpus, vocab_size, min_freq)
    dtype = np.dtype(np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32)
    sample_bytes = (seq_len + 1) * dtype.itemsize
    if shard_bytes < sample_bytes:
        raise DataError(
            f"--shard-bytes {shard_bytes} cannot hold one sample ({sample_bytes} bytes at "
            f"seq_len {seq_len}); use at least {sample_bytes}"
        )
    by_split = _split_documents(corpus.documents, val_fraction, test_fraction)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        split_meta, counts = _write_splits(tmp, tok, by_split, dtype, seq_len, shard_bytes, zstd)
        if split_meta["train"]["samples"] == 0:
            raise DataError(
                f"the training split has {split_meta['train']['tokens']} tokens, fewer than one "
                f"sample of seq_len+1={seq_len + 1}; add text or lower --seq-len"
            )
        tokenizer_json = tokenizer_text if tokenizer_text is not None else tok.to_str()
        (tmp / TOKENIZER_NAME).write_bytes(tokenizer_json.encode("utf-8"))
        metadata = {
            "format": FORMAT,
            "fingerprint": fingerprint,
            "settings": settings,
            "vocab_size": tok.get_vocab_size(),
            "seq_len": seq_len,
            "sample_len": seq_len + 1,
            "dtype": dtype.name,
            "compression": "zstd" if zstd else None,
            "eot_token": EOT_TOKEN,
            "eot_id": tok.token_to_id(EOT_TOKEN),
            "tokenizer": TOKENIZER_NAME,
            "tokenizer_sha256": sha256_file(tmp / TOKENIZER_NAME),
            "inputs": [asdict(source) for source in corpus.sources],
            "documents": asdict(corpus.stats),
            "splits": split_meta,
            "token_stats": _token_stats(tok, counts, corpus.stats.characters),
        }
        write_json_atomic(tmp / METADATA_NAME, metadata)
        _replace_dir(tmp, out)
    except OSError as error:
        raise DataError(
            f"cannot write the dataset to {out} ({error.strerror}); check free space and "
            "permissions of its parent directory"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return metadata


def _check_out_dir(out: Path) -> None:
    # Refuse early to replace a directory that is not a dataset: it may be someone's data.
    if out.exists() and (
        not out.is_dir() or (any(out.iterdir()) and not (out / METADATA_NAME).exists())
    ):
        raise DataError(
            f"--out {out} exists and is not a prepared dataset; choose a new or empty directory"
        )


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished dataset into place: readers see the old one or the new one, not a mix."""
    if out.exists():
        if not any(out.iterdir()):
            out.rmdir()
        else:
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
            return
    os.rename(tmp, out)


def _fingerprint(settings: dict[str, Any], corpus: Corpus) -> str:
    # Content, not paths: the same files prepared from another directory get the same fingerprint.
    payload = {"settings": settings, "inputs": [source.sha256 for source in corpus.sources]}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def _read_tokenizer_file(path: str | Path) -> str:
    from tokenizers import Tokenizer

    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
        tok = Tokenizer.from_str(text)
    except OSError as error:
        raise DataError(
            f"cannot read --tokenizer {path} ({error.strerror}); check the path"
        ) from None
    except UnicodeDecodeError:
        raise DataError(f"--tokenizer {path} is not UTF-8 JSON; give a tokenizer.json") from None
    except Exception as error:  # tokenizers raises a bare Exception on a malformed file
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise DataError(
            f"--tokenizer {path} is not a valid tokenizer.json ({first_line}); "
            "give one saved by the tokenizers library"
        ) from None
    if tok.token_to_id(EOT_TOKEN) is None:
        raise DataError(
            f"--tokenizer {path} has no {EOT_TOKEN} token; add it as a special token or let "
            "prepare train a tokenizer (omit --tokenizer)"
        )
    return text


def _load_or_train_tokenizer(
    tokenizer_text: str | None, corpus: Corpus, vocab_size: int, min_freq: int
) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if tokenizer_text is not None:
        return Tokenizer.from_str(tokenizer_text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_freq,
        special_tokens=[EOT_TOKEN],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Merges are chosen by (count, pair) with deterministic tie-breaking, so the same documents
    # in the same order give byte-identical tokenizer.json files (checked by the tests).
    tok.train_from_iterator((doc.text for doc in corpus.documents), trainer)
    return tok


def split_of(digest: bytes, val_fraction: float, test_fraction: float) -> str:
    """The split of a document, from its content hash alone.

    Adding or removing documents never moves another one between splits, and exact duplicates
    (removed anyway) could never land on both sides of the train/val boundary.
    """
    point = int.from_bytes(digest[:8], "big") / 2.0**64
    if point < val_fraction:
        return "val"
    if point < val_fraction + test_fraction:
        return "test"
    return "train"


def _split_documents(
    documents: Iterable[Document], val_fraction: float, test_fraction: float
) -> dict[str, list[Document]]:
    by_split: dict[str, list[Document]] = {split: [] for split in SPLITS}
    for doc in documents:
        by_split[split_of(doc.digest, val_fraction, test_fraction)].append(doc)
    return by_split


def _write_splits(
    directory: Path,
    tok: Any,
    by_split: dict[str, list[Document]],
    dtype: np.dtype,
    seq_len: int,
    shard_bytes: int,
    zstd: bool,
) -> tuple[dict[str, Any], np.ndarray]:
    """Tokenise, pack and shard every split; returns their metadata and token counts."""
    eot_id = tok.token_to_id(EOT_TOKEN)
    counts = np.zeros(tok.get_vocab_size(), dtype=np.int64)
    splits: dict[str, Any] = {}
    for split in SPLITS:
        stream = _token_stream(tok, by_split[split], eot_id, dtype)
        counts += np.bincount(stream, minlength=counts.size)[: counts.size]
        samples = _pack(stream, seq_len)
        covered = samples.shape[0] * seq_len + 1 if samples.shape[0] else 0
        splits[split] = {
            "documents": len(by_split[split]),
            "tokens": int(stream.size),
            "samples": int(samples.shape[0]),
            "dropped_tokens": int(stream.size - covered),
            "shards": _write_shards(directory, split, samples, shard_bytes, zstd),
        }
    return splits, counts


def _token_stream(tok: Any, documents: list[Document], eot_id: int, dtype: np.dtype) -> np.ndarray:
    """Every document's tokens followed by end-of-text, in input order."""
    if not documents:
        return np.zeros(0, dtype=dtype)
    encodings = tok.encode_batch([doc.text for doc in documents], add_special_tokens=False)
    eot = np.array([eot_id], dtype=dtype)
    parts = []
    for encoding in encodings:
        parts.append(np.asarray(encoding.ids, dtype=dtype))
        parts.append(eot)
    return np.concatenate(parts)


def _pack(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Samples of seq_len+1 tokens starting every seq_len tokens.

    Consecutive samples share one boundary token, so every adjacent token pair of the stream is
    a training target exactly once; the tail shorter than a sample is dropped.
    """
    count = max(0, (stream.size - 1) // seq_len)
    if count == 0:
        return np.zeros((0, seq_len + 1), dtype=stream.dtype)
    windows = np.lib.stride_tricks.sliding_window_view(stream, seq_len + 1)
    return np.ascontiguousarray(windows[::seq_len][:count])


def _write_shards(
    directory: Path,
    split: str,
    samples: np.ndarray,
    shard_bytes: int,
    zstd: bool,
) -> list[dict[str, Any]]:
    per_shard = shard_bytes // (samples.shape[1] * samples.itemsize)
    compressor = None
    if zstd:
        import zstandard

        compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=0)
    row_bytes = samples.shape[1] * samples.itemsize
    frame_samples = max(1, ZSTD_FRAME_BYTES // row_bytes)
    shards = []
    for number, first in enumerate(range(0, samples.shape[0], per_shard)):
        rows = samples[first : first + per_shard]
        payload = rows.tobytes()
        name = f"{split}-{number:05d}.bin"
        frames: dict[str, Any] = {}
        if compressor is not None:
            parts = [
                compressor.compress(rows[i : i + frame_samples].tobytes())
                for i in range(0, rows.shape[0], frame_samples)
            ]
            offsets = np.cumsum([0, *(len(part) for part in parts[:-1])]).tolist()
            frames = {"frame_samples": frame_samples, "frame_offsets": offsets}
            payload = b"".join(parts)
            name += ".zst"
        path = directory / name
        with open(path, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        shards.append(
            {
                "name": name,
                "first_sample": first,
                "samples": int(rows.shape[0]),
                "tokens": int(rows.size),
                "bytes": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
                **frames,
            }
        )
    return shards


def _token_stats(tok: Any, counts: np.ndarray, characters: int) -> dict[str, Any]:
    total = int(counts.sum())
    probabilities = counts[counts > 0] / max(total, 1)
    top = np.argsort(-counts, kind="stable")[:TOP_TOKENS]
    return {
        "total": total,
        "distinct": int((counts > 0).sum()),
        "unigram_entropy_bits": round(float(-(probabilities * np.log2(probabilities)).sum()), 6),
        "characters_per_token": round(characters / max(total, 1), 6),
        "top": [
            {"id": int(i), "text": tok.decode([int(i)], skip_special_tokens=False), "count": int(c)}
            for i, c in zip(top, counts[top], strict=True)
            if c > 0
        ],
    }


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardRange:
    name: str
    start: int  # first sample index (within the split)
    stop: int  # one past the last


class TokenDataset(torch.utils.data.Dataset[torch.Tensor]):
    """One split of a prepared dataset; `ds[i]` is a LongTensor of seq_len+1 token ids.

    Uncompressed shards are memory-mapped. zstd shards are read one frame at a time (`pread` of
    its bytes, then decompress) and the decompressed frames are kept in an LRU cache of at most
    `cache_bytes` (at least one frame): under a global shuffle a process never holds more than
    that, whatever the size of the split. Nothing is opened in the constructor beyond size
    checks, so the dataset pickles cheaply into DataLoader workers.
    """

    def __init__(
        self,
        path: str | Path,
        split: str = "train",
        *,
        allow_empty: bool = False,
        verify: str = "size",
        cache_bytes: int = CACHE_BYTES,
    ):
        self.path = Path(path)
        self.split = split
        metadata = read_json(self.path / METADATA_NAME)
        if not isinstance(metadata, dict):
            raise DataError(
                f"{self.path} has no readable {METADATA_NAME}; prepare it with "
                f"`python -m trainer prepare --out {self.path}`"
            )
        if metadata.get("format") != FORMAT:
            raise DataError(
                f"{self.path} has dataset format {metadata.get('format')}, this trainer reads "
                f"{FORMAT}; prepare it again"
            )
        self.metadata: dict[str, Any] = metadata
        try:
            splits = metadata["splits"]
            if split not in splits:
                raise DataError(
                    f"{self.path} has no split {split!r}; choose one of {sorted(splits)}"
                )
            self.vocab_size: int = int(metadata["vocab_size"])
            self.seq_len: int = int(metadata["seq_len"])
            self.fingerprint: str = str(metadata["fingerprint"])
            self._dtype = np.dtype(metadata["dtype"])
            self._sample_len = int(metadata["sample_len"])
            self._entries = list(splits[split]["shards"])
            self.shards = [
                ShardRange(e["name"], e["first_sample"], e["first_sample"] + e["samples"])
                for e in self._entries
            ]
            sizes = [int(entry["bytes"]) for entry in self._entries]
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(
                f"{self.path / METADATA_NAME} is incomplete ({type(error).__name__}: {error}); "
                "prepare the dataset again"
            ) from None
        self._starts = [shard.start for shard in self.shards]
        self._length = self.shards[-1].stop if self.shards else 0
        if self._length == 0 and not allow_empty:
            raise DataError(
                f"split {split!r} of {self.path} has no samples; add text or lower --seq-len"
            )
        for shard, size in zip(self.shards, sizes, strict=True):
            shard_path = self.path / shard.name
            try:
                actual = shard_path.stat().st_size
            except OSError:
                raise DataError(
                    f"shard {shard_path} is missing; copy the whole dataset or prepare it again"
                ) from None
            if actual != size:
                raise DataError(
                    f"shard {shard_path} has {actual} bytes, metadata says {size} "
                    f"(truncated or replaced); {self.fix_hint}"
                )
        if verify == "full":
            self.verify_checksums()
        self._arrays: dict[int, np.ndarray] = {}
        self.cache_bytes = cache_bytes
        self._frames: collections.OrderedDict[tuple[int, int], np.ndarray] = (
            collections.OrderedDict()
        )
        self._frame_bytes = 0

    @property
    def fix_hint(self) -> str:
        return "re-prepare the dataset (python -m trainer prepare --out DIR) or restore it and run prepare --check"

    def verify_checksums(self) -> int:
        """sha256 of every shard of the split against metadata.json; the bytes read."""
        total = 0
        for entry in self._entries:
            shard_path = self.path / entry["name"]
            try:
                digest = sha256_file(shard_path)
                total += shard_path.stat().st_size
            except OSError as error:
                raise DataError(f"shard {shard_path}: {error.strerror}; {self.fix_hint}") from None
            if digest != entry.get("sha256"):
                raise DataError(
                    f"shard {shard_path} does not match its sha256 in {METADATA_NAME} "
                    f"(replaced or corrupted); {self.fix_hint}"
                )
        return total

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} out of range for {self._length} samples")
        number = bisect.bisect_right(self._starts, index) - 1
        local = index - self.shards[number].start
        entry = self._entries[number]
        if self.metadata.get("compression") == "zstd":
            # Shards written before frames existed are one frame.
            per_frame = int(entry.get("frame_samples") or entry["samples"])
            frame = self._frame(number, local // per_frame, per_frame)
            row = frame[local % per_frame]
        else:
            row = self._array(number)[local]
        # Cheap (one pass over seq_len ids) and what turns a corrupt shard into a data error
        # instead of an embedding IndexError.
        if row.size and int(row.max()) >= self.vocab_size:
            shard_path = self.path / self.shards[number].name
            raise DataError(
                f"shard {shard_path} holds token id {int(row.max())} >= vocab size "
                f"{self.vocab_size} at sample {index} (corrupted or replaced); {self.fix_hint}"
            )
        return torch.from_numpy(row.astype(np.int64))

    def shard_of(self, index: int) -> str:
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} out of range for {self._length} samples")
        return self.shards[bisect.bisect_right(self._starts, index) - 1].name

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrays"] = {}  # workers map/decompress their own copies
        state["_frames"], state["_frame_bytes"] = collections.OrderedDict(), 0
        return state

    def _frame(self, number: int, frame: int, per_frame: int) -> np.ndarray:
        """Decompressed frame `frame` of zstd shard `number` (rows × sample_len), via the LRU."""
        key = (number, frame)
        cached = self._frames.get(key)
        if cached is not None:
            self._frames.move_to_end(key)
            return cached
        import zstandard

        entry = self._entries[number]
        offsets = entry.get("frame_offsets") or [0]
        start = offsets[frame]
        stop = offsets[frame + 1] if frame + 1 < len(offsets) else int(entry["bytes"])
        rows = min(per_frame, int(entry["samples"]) - frame * per_frame)
        expected = rows * self._sample_len * self._dtype.itemsize
        shard_path = self.path / entry["name"]
        try:
            with open(shard_path, "rb") as f:
                compressed = os.pread(f.fileno(), stop - start, start)
            raw = zstandard.ZstdDecompressor().decompress(compressed, max_output_size=expected)
        except zstandard.ZstdError as error:
            raise DataError(
                f"shard {shard_path} does not decompress ({error}); {self.fix_hint}"
            ) from None
        if len(raw) != expected:
            raise DataError(
                f"shard {shard_path} frame {frame} holds {len(raw)} bytes, expected {expected}; "
                f"{self.fix_hint}"
            )
        array = np.frombuffer(raw, dtype=self._dtype).reshape(rows, self._sample_len)
        self._frames[key] = array
        self._frame_bytes += array.nbytes
        while self._frame_bytes > self.cache_bytes and len(self._frames) > 1:
            _, evicted = self._frames.popitem(last=False)
            self._frame_bytes -= evicted.nbytes
        return array

    def _array(self, number: int) -> np.ndarray:
        """Uncompressed shard `number`, memory-mapped (the page cache holds it, not the heap)."""
        array = self._arrays.get(number)
        if array is None:
            entry = self._entries[number]
            shape = (entry["samples"], self._sample_len)
            path = self.path / entry["name"]
            array = np.memmap(path, dtype=self._dtype, mode="r", shape=shape)
            self._arrays[number] = array
        return array


def check_dataset(path: str | Path) -> dict[str, Any]:
    """`prepare --check`: every split's shards against their sizes and sha256, and the
    tokenizer against its digest; DataError on the first mismatch. Reads only."""
    path = Path(path)
    metadata = read_json(path / METADATA_NAME)
    if not isinstance(metadata, dict) or not isinstance(metadata.get("splits"), dict):
        TokenDataset(path)  # raises the error that names what is missing
        raise DataError(f"{path / METADATA_NAME} lists no splits; prepare the dataset again")
    splits, checked = {}, 0
    for split in metadata["splits"]:
        dataset = TokenDataset(path, split, allow_empty=True)
        checked += dataset.verify_checksums()
        splits[split] = len(dataset.shards)
    tokenizer = path / TOKENIZER_NAME
    expected = metadata.get("tokenizer_sha256")
    if expected and (not tokenizer.is_file() or sha256_file(tokenizer) != expected):
        raise DataError(
            f"{tokenizer} is missing or does not match its sha256 in {METADATA_NAME}; "
            f"prepare the dataset again (python -m trainer prepare --out {path} ...)"
        )
    return {"splits": splits, "bytes": checked}


# ------------------------------------------------------------------------------------------------
# global order
# ------------------------------------------------------------------------------------------------


class GlobalSampler:
    """Maps a global position (counting samples since step 0, across epochs) to a sample index.

    Epoch e = position // num_samples visits every sample once, in the order of a pseudo-random
    permutation keyed by (seed, e). Nothing depends on the number of ranks or on how far an earlier
    process got, which is what makes a resume on a different world size exact.

    The permutation is a Feistel network over the smallest power-of-four domain that holds
    num_samples, with cycle-walking back into range: any position maps to its index in O(1) time
    and memory (no N-element array per epoch), and the order depends only on integer arithmetic
    defined here, not on a library's random-stream version.
    """

    ROUNDS = 6

    def __init__(self, num_samples: int, seed: int) -> None:
        if num_samples <= 0:
            raise DataError(f"cannot sample from {num_samples} samples; prepare more data")
        self.num_samples = num_samples
        self.seed = seed
        self._half_bits = max(1, (max(num_samples - 1, 1).bit_length() + 1) // 2)

    def epoch(self, position: int) -> int:
        _check_position(position)
        return position // self.num_samples

    def index(self, position: int) -> int:
        return self.indices([position])[0]

    def indices(self, positions: Iterable[int]) -> list[int]:
        positions = np.asarray(list(positions), dtype=np.int64).reshape(-1)
        if positions.size and positions.min() < 0:
            raise ValueError(f"global position {int(positions.min())} is negative")
        epochs = positions // self.num_samples
        result = np.empty_like(positions)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            offsets = positions[chosen] - epoch * self.num_samples
            result[chosen] = self._permute(offsets.astype(np.uint64), int(epoch))
        return result.tolist()

    def permutation(self, epoch: int, stop: int | None = None) -> np.ndarray:
        """Sample indices read at offsets [0, stop) of `epoch` (the whole epoch by default)."""
        stop = self.num_samples if stop is None else stop
        return self._permute(np.arange(stop, dtype=np.uint64), epoch).astype(np.int64)

    def _permute(self, values: np.ndarray, epoch: int) -> np.ndarray:
        keys = _round_keys(self.seed, epoch, self.ROUNDS)
        result = np.empty_like(values)
        for first in range(0, values.size, _CHUNK):
            chunk = _feistel(values[first : first + _CHUNK], keys, self._half_bits)
            # Cycle-walking: a bijection of the power-of-four domain, re-applied to the values
            # that land outside [0, num_samples), is a bijection of [0, num_samples).
            outside = np.flatnonzero(chunk >= self.num_samples)
            while outside.size:
                chunk[outside] = _feistel(chunk[outside], keys, self._half_bits)
                outside = outside[chunk[outside] >= self.num_samples]
            result[first : first + _CHUNK] = chunk
        return result


_CHUNK = 1 << 16  # cache-sized pieces: several times faster than whole-array passes


def _round_keys(seed: int, epoch: int, rounds: int) -> list[np.uint64]:
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8 * rounds).digest()
    return [np.uint64(int.from_bytes(digest[8 * i : 8 * i + 8], "little")) for i in range(rounds)]


def _feistel(values: np.ndarray, keys: list[np.uint64], half_bits: int) -> np.ndarray:
    """One pass of a balanced Feistel network on 2*half_bits-bit values (a bijection)."""
    shift = np.uint64(half_bits)
    mask = np.uint64((1 << half_bits) - 1)
    left = values >> shift
    right = values & mask
    scratch = np.empty_like(right)
    work = np.empty_like(right)
    for key in keys:
        # Round function: splitmix64's finaliser of (right ^ key), computed in place.
        np.bitwise_xor(right, key, out=work)
        for bits, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            np.right_shift(work, np.uint64(bits), out=scratch)
            np.bitwise_xor(work, scratch, out=work)
            np.multiply(work, np.uint64(factor), out=work)
        np.right_shift(work, np.uint64(31), out=scratch)
        np.bitwise_xor(work, scratch, out=work)
        np.bitwise_and(work, mask, out=work)
        np.bitwise_xor(work, left, out=work)
        left, right, work = right, work, left
    return (left << shift) | right


def _check_position(position: int) -> None:
    if position < 0:
        raise ValueError(f"global position {position} is negative")


def rank_positions(start: int, global_batch: int, rank: int, world_size: int) -> list[int]:
    """The global positions [start, start + global_batch) that `rank` reads, strided by rank.

    The union over ranks is the whole range for every world size, so the samples of a step do not
    depend on how many ranks share it.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}")
    if global_batch < 1 or global_batch % world_size:
        raise ConfigError(
            f"global batch {global_batch} is not divisible by world size {world_size}; "
            f"use a multiple of {world_size}"
        )
    _check_position(start)
    return list(range(start + rank, start + global_batch, world_size))


def consumed_shards(dataset: TokenDataset, sampler: GlobalSampler, position: int) -> list[str]:
    """Shards whose every sample was read in the current epoch, before `position`.

    The current epoch is `sampler.epoch(position)`; every earlier epoch read every shard, so a
    checkpoint records this list together with the epoch. At an epoch boundary the list is empty.
    O(shards) per call: the offset at which each shard is finished is computed once per epoch.
    """
    if sampler.num_samples != len(dataset):
        raise ValueError(f"sampler has {sampler.num_samples} samples, dataset {len(dataset)}")
    epoch = sampler.epoch(position)
    done = position - epoch * sampler.num_samples
    starts = tuple(shard.start for shard in dataset.shards)
    finished = _shard_finish_offsets(sampler.num_samples, sampler.seed, epoch, starts)
    return [shard.name for shard, last in zip(dataset.shards, finished, strict=True) if last < done]


@functools.lru_cache(maxsize=2)
def _shard_finish_offsets(
    num_samples: int, seed: int, epoch: int, starts: tuple[int, ...]
) -> np.ndarray:
    """For each shard, the epoch offset at which its last sample is read (one O(N) pass)."""
    order = GlobalSampler(num_samples, seed).permutation(epoch)
    shard_of_read = np.searchsorted(np.asarray(starts), order, side="right") - 1
    finished = np.full(len(starts), -1, dtype=np.int64)
    np.maximum.at(finished, shard_of_read, np.arange(num_samples, dtype=np.int64))
    return finished


def sample_seed(seed: int, position: int) -> int:
    """A 63-bit seed for the sample at a global position (e.g. for its latent-state noise)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
