"""trainer.data: prepare (determinism, cleaning, splits, shards) and the global-index loader."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.corpus import clean_text
from trainer.data import (
    EOT_TOKEN,
    METADATA_NAME,
    TOKENIZER_NAME,
    GlobalSampler,
    TokenDataset,
    consumed_shards,
    prepare,
    rank_positions,
    sample_seed,
    split_of,
)
from trainer.errors import ConfigError, DataError

WORDS = ["alpha", "beta", "gamma", "delta", "loop", "core", "state", "depth", "token", "shard"]


def make_docs(count: int, words: int = 60, first: int = 0) -> list[str]:
    """Distinct documents, each opening with a marker that names it."""
    docs = []
    for number in range(first, first + count):
        state = number * 2654435761 + 1
        body = []
        for _ in range(words):
            state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
            body.append(WORDS[(state >> 33) % len(WORDS)])
        docs.append(f"marker{number}x " + " ".join(body) + ".")
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs), encoding="utf-8")
    return path


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def split_stream(path: Path, split: str) -> np.ndarray:
    """The token stream a split was packed from, rebuilt from its overlapping samples."""
    ds = TokenDataset(path, split)
    parts = [ds[0].numpy()] + [ds[i].numpy()[1:] for i in range(1, len(ds))]
    return np.concatenate(parts)


def decode(path: Path, ids: np.ndarray) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / TOKENIZER_NAME))
    return tok.decode(ids.tolist(), skip_special_tokens=False)


# ----------------------------------------------------------------------------------------------
# prepare
# ----------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_prepare_is_byte_identical_across_runs_and_processes(tmp_path: Path) -> None:
    first = prepare(tmp_path / "a", seq_len=32, vocab_size=1024, zstd=True)
    # A fresh interpreter with another hash seed: BPE ties must not depend on hash order.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    code = (
        "import sys; from trainer.data import prepare; "
        "prepare(sys.argv[1], seq_len=32, vocab_size=1024, zstd=True)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "b")], check=True, env=env)

    assert TokenDataset(tmp_path / "b").fingerprint == first["fingerprint"]
    reference = dir_bytes(tmp_path / "a")
    assert {METADATA_NAME, TOKENIZER_NAME, "train-00000.bin.zst"} <= set(reference)
    assert dir_bytes(tmp_path / "b") == reference


def test_different_settings_give_different_fingerprints(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "docs.jsonl", make_docs(30))
    base = prepare(tmp_path / "base", [corpus], seq_len=16, vocab_size=300)
    others = [
        prepare(tmp_path / "seq", [corpus], seq_len=17, vocab_size=300),
        prepare(tmp_path / "vocab", [corpus], seq_len=16, vocab_size=320),
        prepare(tmp_path / "zstd", [corpus], seq_len=16, vocab_size=300, zstd=True),
        prepare(tmp_path / "freq", [corpus], seq_len=16, vocab_size=300, min_freq=5),
    ]
    write_jsonl(corpus, make_docs(31))
    others.append(prepare(tmp_path / "input", [corpus], seq_len=16, vocab_size=300))
    fingerprints = {base["fingerprint"], *(meta["fingerprint"] for meta in others)}
    assert len(fingerprints) == 1 + len(others)


def test_prepare_again_is_a_no_op_and_repairs_damage(prepared_data: Path, tmp_path: Path) -> None:
    out = tmp_path / "data"
    shutil.copytree(prepared_data, out)
    reference = dir_bytes(out)
    shard = out / "train-00000.bin"
    mtime = shard.stat().st_mtime_ns
    assert prepare(out, seq_len=64, vocab_size=4096)["fingerprint"] == TokenDataset(out).fingerprint
    assert shard.stat().st_mtime_ns == mtime  # untouched

    shard.write_bytes(shard.read_bytes()[:100])
    prepare(out, seq_len=64, vocab_size=4096)
    assert dir_bytes(out) == reference


def test_exact_duplicates_are_kept_once(tmp_path: Path) -> None:
    docs = make_docs(20)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for number, doc in enumerate(docs):
        (corpus / f"{number:02d}.txt").write_text(doc, encoding="utf-8")
    (corpus / "copy.txt").write_text(docs[3], encoding="utf-8")
    (corpus / "blank.txt").write_text(" \n\t\x00\n", encoding="utf-8")
    (corpus / "ignored.csv").write_text("not,a,document", encoding="utf-8")
    jsonl = write_jsonl(tmp_path / "more.jsonl", [docs[5], docs[5], *make_docs(5, first=20)])

    meta = prepare(tmp_path / "out", [corpus, jsonl], seq_len=16, vocab_size=300)

    assert meta["documents"] == {
        **meta["documents"],
        "read": 21 + 1 + 7,
        "empty": 1,
        "duplicates": 3,
        "kept": 25,
    }
    assert sum(split["documents"] for split in meta["splits"].values()) == 25
    assert len(meta["inputs"]) == 23  # every file read, each with its digest
    text = "".join(decode(tmp_path / "out", split_stream(tmp_path / "out", s)) for s in ("train",))
    assert len(re.findall(r"marker3x", text)) <= 1


def test_cleaning_normalises_and_strips_control_characters(tmp_path: Path) -> None:
    assert clean_text("cafe\u0301\x00\x07 a\r\nb\rc\td\x7f\x85") == (
        "caf\u00e9 a\nb\nc\td",
        4,
        True,
    )
    assert clean_text("plain\ttext\n") == ("plain\ttext\n", 0, False)
    # NFC keeps compatibility characters (NFKC would turn "x²" into "x2" and "ﬁ" into "fi").
    assert clean_text("x\u00b2 \ufb01")[0] == "x\u00b2 \ufb01"

    docs = [doc.replace("alpha", "ALPHA\x01\x1b") for doc in make_docs(30)]
    docs[0] = "e\u0301" + docs[0]
    meta = prepare(
        tmp_path / "out",
        [write_jsonl(tmp_path / "d.jsonl", docs)],
        seq_len=16,
        vocab_size=300,
        val_fraction=0,
        test_fraction=0,
    )
    assert meta["documents"]["changed_by_normalization"] == 1
    assert meta["documents"]["control_chars_removed"] > 0
    text = decode(tmp_path / "out", split_stream(tmp_path / "out", "train"))
    assert "ALPHA" in text
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", text)
    assert "e\u0301" not in text and "\u00e9" in text


def test_packing_joins_documents_with_end_of_text(tmp_path: Path) -> None:
    docs = make_docs(12)
    out = tmp_path / "out"
    meta = prepare(
        out, [write_jsonl(tmp_path / "d.jsonl", docs)], seq_len=16, vocab_size=300, val_fraction=0
    )
    train_docs = [d for d in docs if split_of(_digest(d), 0, 0.05) == "train"]
    expected = "".join(doc + EOT_TOKEN for doc in train_docs)
    stream = split_stream(out, "train")
    split = meta["splits"]["train"]
    assert stream.size == split["tokens"] - split["dropped_tokens"]
    assert 0 <= split["dropped_tokens"] <= 16
    decoded = decode(out, stream)
    assert expected.startswith(decoded) and len(decoded) > len(expected) - 200

    ds = TokenDataset(out, "train")
    sample = ds[1]
    assert sample.dtype == torch.int64 and sample.shape == (17,)
    assert torch.equal(sample[0], ds[0][-1])  # consecutive samples share their boundary token
    assert meta["eot_id"] == 0 and meta["dtype"] == "uint16"
    stats = meta["token_stats"]
    assert stats["total"] == sum(s["tokens"] for s in meta["splits"].values())
    assert 0 < stats["unigram_entropy_bits"] < np.log2(meta["vocab_size"])
    assert stats["top"][0]["count"] >= stats["top"][-1]["count"]


def _digest(text: str) -> bytes:
    import hashlib

    return hashlib.sha256(clean_text(text)[0].encode()).digest()


def test_split_is_by_document_and_stable_when_documents_are_added(tmp_path: Path) -> None:
    docs = make_docs(60)
    kwargs = {"seq_len": 8, "vocab_size": 300, "val_fraction": 0.2, "test_fraction": 0.2}
    prepare(tmp_path / "old", [write_jsonl(tmp_path / "old.jsonl", docs)], **kwargs)
    more = [*docs[:30], *make_docs(10, first=100), *docs[30:]]
    prepare(tmp_path / "new", [write_jsonl(tmp_path / "new.jsonl", more)], **kwargs)

    def markers(path: Path, split: str) -> set[int]:
        text = decode(path, split_stream(path, split))
        return {int(m) for m in re.findall(r"marker(\d+)x", text)}

    old = {split: markers(tmp_path / "old", split) for split in ("train", "val", "test")}
    new = {split: markers(tmp_path / "new", split) for split in ("train", "val", "test")}
    assert all(old.values())
    assert old["train"].isdisjoint(old["val"] | old["test"]) and old["val"].isdisjoint(old["test"])
    assert set().union(*old.values()) == set(range(60))
    for split in old:
        assert old[split] <= new[split]  # no old document moved to another split
    assert {split_of(bytes([i]) * 32, 0.2, 0.2) for i in range(256)} == {"train", "val", "test"}


def test_shards_respect_the_size_cap_and_zstd_round_trips(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "d.jsonl", make_docs(40))
    cap = 10 * 33 * 2 + 5  # ten samples of seq_len 32 (33 uint16 tokens) and a bit
    plain = prepare(tmp_path / "plain", [corpus], seq_len=32, vocab_size=300, shard_bytes=cap)
    packed = prepare(
        tmp_path / "zst", [corpus], seq_len=32, vocab_size=300, shard_bytes=cap, zstd=True
    )
    shards = plain["splits"]["train"]["shards"]
    assert len(shards) > 2
    for entry in shards:
        assert (tmp_path / "plain" / entry["name"]).stat().st_size == entry["bytes"] <= cap
        assert entry["samples"] == 10 or entry is shards[-1]
    assert packed["compression"] == "zstd"
    assert all(e["name"].endswith(".bin.zst") for e in packed["splits"]["train"]["shards"])

    a, b = TokenDataset(tmp_path / "plain"), TokenDataset(tmp_path / "zst")
    assert len(a) == len(b) == plain["splits"]["train"]["samples"]
    assert all(torch.equal(a[i], b[i]) for i in range(len(a)))
    assert [s.name for s in a.shards][:2] == ["train-00000.bin", "train-00001.bin"]
    assert a.shards[1].start == 10 and a.shards[1].stop == 20
    assert a.shard_of(0) == "train-00000.bin" and a.shard_of(len(a) - 1) == a.shards[-1].name
    clone = pickle.loads(pickle.dumps(b))  # DataLoader workers get their own decompressed copy
    assert torch.equal(clone[len(b) - 1], b[len(b) - 1])


def test_an_existing_tokenizer_is_reused(prepared_data: Path, tmp_path: Path) -> None:
    tokenizer = prepared_data / TOKENIZER_NAME
    corpus = write_jsonl(tmp_path / "d.jsonl", make_docs(20))
    meta = prepare(tmp_path / "out", [corpus], seq_len=16, vocab_size=999, tokenizer=tokenizer)
    assert (tmp_path / "out" / TOKENIZER_NAME).read_bytes() == tokenizer.read_bytes()
    assert meta["vocab_size"] == 4096 and "vocab_size" not in meta["settings"]
    trained = prepare(tmp_path / "trained", [corpus], seq_len=16, vocab_size=4096)
    assert trained["fingerprint"] != meta["fingerprint"]


@pytest.mark.integration
def test_vocabularies_over_65536_use_uint32_shards(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens([EOT_TOKEN])
    tok.add_tokens([f"zz{i:05d}" for i in range(66_000)])
    tok.save(str(tmp_path / "big.json"))
    docs = [f"{doc} zz65999 zz00001" for doc in make_docs(10)]
    out = tmp_path / "out"
    meta = prepare(
        out, [write_jsonl(tmp_path / "d.jsonl", docs)], seq_len=8, tokenizer=tmp_path / "big.json"
    )
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 65_536
    stream = split_stream(out, "train")
    assert int(stream.max()) == tok.token_to_id("zz65999") > 65_535


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------


def one_line_error(call, match: str) -> str:
    with pytest.raises(DataError, match=match) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and len(message) < 300
    return message


def test_bad_prepare_inputs_are_one_line_data_errors(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "d.jsonl", make_docs(5))
    out = tmp_path / "out"
    one_line_error(lambda: prepare(out, [tmp_path / "nope.txt"]), "nope.txt does not exist")
    (tmp_path / "blank.txt").write_text("\x00 \n\n\x1b", encoding="utf-8")
    one_line_error(lambda: prepare(out, [tmp_path / "blank.txt"]), "no documents left")
    one_line_error(lambda: prepare(out, [corpus], vocab_size=100), "at least 257")
    one_line_error(lambda: prepare(out, [corpus], seq_len=1), "at least 2")
    one_line_error(lambda: prepare(out, [corpus], shard_bytes=10), "cannot hold one sample")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": 1}\n', encoding="utf-8")
    one_line_error(lambda: prepare(out, [tmp_path / "bad.jsonl"]), r"bad.jsonl:2 .*\"text\"")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    one_line_error(lambda: prepare(out, [tmp_path / "latin1.txt"]), "not UTF-8")
    (tmp_path / "empty_dir").mkdir()
    one_line_error(lambda: prepare(out, [tmp_path / "empty_dir"]), "no .txt or .jsonl")
    blocked = tmp_path / "d.jsonl" / "data"  # parent is a file
    one_line_error(lambda: prepare(blocked, [corpus], vocab_size=300), "cannot write the dataset")

    (tmp_path / "garbage.json").write_text("{not json", encoding="utf-8")
    bad_tok = tmp_path / "garbage.json"
    one_line_error(lambda: prepare(out, [corpus], tokenizer=bad_tok), "not a valid tokenizer")
    missing_tok = tmp_path / "missing.json"
    one_line_error(lambda: prepare(out, [corpus], tokenizer=missing_tok), "cannot read")
    assert not out.exists()


def test_tokenizer_without_end_of_text_is_rejected(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(make_docs(5), trainers.BpeTrainer(vocab_size=300, show_progress=False))
    tok.save(str(tmp_path / "tok.json"))
    corpus = write_jsonl(tmp_path / "d.jsonl", make_docs(5))
    one_line_error(
        lambda: prepare(tmp_path / "out", [corpus], tokenizer=tmp_path / "tok.json"), EOT_TOKEN
    )


def test_failed_prepare_leaves_no_half_dataset(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", make_docs(20))
    tiny = write_jsonl(tmp_path / "tiny.jsonl", ["hi"])
    out = tmp_path / "data"
    one_line_error(lambda: prepare(out, [tiny], seq_len=64, vocab_size=300), "fewer than one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.jsonl", "tiny.jsonl"]

    before = prepare(out, [good], seq_len=8, vocab_size=300)
    one_line_error(lambda: prepare(out, [tiny], seq_len=64, vocab_size=300), "fewer than one")
    assert TokenDataset(out).fingerprint == before["fingerprint"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "good.jsonl", "tiny.jsonl"]

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me", encoding="utf-8")
    one_line_error(lambda: prepare(precious, [good]), "not a prepared dataset")
    assert (precious / "notes.txt").read_text(encoding="utf-8") == "keep me"


def test_damaged_dataset_directories_are_data_errors(prepared_data: Path, tmp_path: Path) -> None:
    one_line_error(lambda: TokenDataset(tmp_path), "no readable metadata.json")
    data = tmp_path / "data"
    shutil.copytree(prepared_data, data)
    one_line_error(lambda: TokenDataset(data, "dev"), "no split 'dev'")
    shard = data / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    one_line_error(lambda: TokenDataset(data), "truncated")
    shard.unlink()
    one_line_error(lambda: TokenDataset(data), "train-00000.bin is missing")
    (data / METADATA_NAME).write_text('{"format": 1, "spl', encoding="utf-8")
    one_line_error(lambda: TokenDataset(data), "no readable metadata.json")
    (data / METADATA_NAME).write_text('{"format": 1, "splits": {"train": {}}}', encoding="utf-8")
    one_line_error(lambda: TokenDataset(data), "metadata.json is incomplete")
    (data / METADATA_NAME).write_text('{"format": 7}', encoding="utf-8")
    one_line_error(lambda: TokenDataset(data), "format 7")


def test_corrupt_zstd_shard_is_a_data_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare(out, [write_jsonl(tmp_path / "d.jsonl", make_docs(10))], seq_len=8, zstd=True)
    shard = out / "train-00000.bin.zst"
    shard.write_bytes(bytes(len(shard.read_bytes())))  # same size, zeroed
    ds = TokenDataset(out)
    one_line_error(lambda: ds[0], "does not decompress")


# ----------------------------------------------------------------------------------------------
# global-index loader
# ----------------------------------------------------------------------------------------------


def test_prepared_fixture_matches_its_contract(prepared_data: Path) -> None:
    ds = TokenDataset(prepared_data, "train")
    assert ds.vocab_size == 4096 and ds.seq_len == 64 and len(ds) > 1000
    assert ds.metadata["settings"]["vocab_size"] == 4096
    assert len(ds.fingerprint) == 64
    assert all(len(TokenDataset(prepared_data, split)) > 0 for split in ("val", "test"))
    batch = torch.stack([ds[i] for i in (0, len(ds) - 1)])
    assert batch.shape == (2, 65) and int(batch.max()) < ds.vocab_size


def test_sampler_is_a_permutation_per_epoch_that_changes_between_epochs() -> None:
    for num_samples in (1, 2, 7, 64, 1000, 70_001):
        sampler = GlobalSampler(num_samples, seed=3)
        epoch0, epoch1 = sampler.permutation(0), sampler.permutation(1)
        assert sorted(epoch0.tolist()) == list(range(num_samples))
        assert sorted(epoch1.tolist()) == list(range(num_samples))
        if num_samples >= 64:
            assert not np.array_equal(epoch0, epoch1)
            assert not np.array_equal(epoch0, np.arange(num_samples))
            assert not np.array_equal(epoch0, GlobalSampler(num_samples, seed=4).permutation(0))
    sampler = GlobalSampler(10, seed=0)
    positions = list(range(35))
    assert sampler.indices(positions) == [sampler.index(p) for p in positions]
    assert [sampler.epoch(p) for p in (0, 9, 10, 34)] == [0, 0, 1, 3]
    assert sampler.index(23) == int(sampler.permutation(2)[3])
    assert GlobalSampler(10, seed=0).indices(positions) == sampler.indices(positions)
    with pytest.raises(ValueError, match="negative"):
        sampler.index(-1)


def test_rank_union_is_the_same_for_any_world_size(prepared_data: Path) -> None:
    ds = TokenDataset(prepared_data, "val")
    sampler = GlobalSampler(len(ds), seed=11)
    global_batch, steps = 6, (len(ds) * 2) // 6 + 2  # runs past two epoch boundaries

    def read(world_size: int) -> list[list[int]]:
        per_step = []
        cursor = 0
        for _ in range(steps):
            positions = []
            for rank in range(world_size):
                mine = rank_positions(cursor, global_batch, rank, world_size)
                assert len(mine) == global_batch // world_size
                positions += mine
            assert sorted(positions) == list(range(cursor, cursor + global_batch))
            per_step.append(sorted(sampler.indices(positions)))
            cursor += global_batch
        return per_step

    reference = read(1)
    assert read(2) == reference and read(3) == reference
    # within each epoch: every sample exactly once (no repeats, no gaps)
    flat = sampler.indices(range(steps * global_batch))
    for epoch in range(2):
        assert sorted(flat[epoch * len(ds) : (epoch + 1) * len(ds)]) == list(range(len(ds)))
    # the same tensors, whichever rank fetched them
    step = rank_positions(len(ds) - 3, global_batch, 0, 1)  # straddles the epoch boundary
    by_one = {sampler.index(p): ds[sampler.index(p)] for p in step}
    for rank in range(3):
        for p in rank_positions(len(ds) - 3, global_batch, rank, 3):
            assert torch.equal(ds[sampler.index(p)], by_one[sampler.index(p)])


def test_rank_positions_rejects_bad_world_sizes() -> None:
    with pytest.raises(ConfigError, match="global batch 10 is not divisible by world size 3"):
        rank_positions(0, 10, 0, 3)
    with pytest.raises(ConfigError, match="rank 3 is outside world size 3"):
        rank_positions(0, 9, 3, 3)
    assert rank_positions(100, 6, 1, 3) == [101, 104]


def test_consumed_shards_follow_the_read_order(tmp_path: Path) -> None:
    out = tmp_path / "out"
    corpus = write_jsonl(tmp_path / "d.jsonl", make_docs(20))
    prepare(out, [corpus], seq_len=8, vocab_size=300, shard_bytes=5 * 9 * 2)
    ds = TokenDataset(out)
    sampler = GlobalSampler(len(ds), seed=5)
    assert len(ds.shards) > 3
    n = len(ds)
    assert consumed_shards(ds, sampler, 0) == []
    for position in (1, n // 2, n - 1, n, n + n // 2, 2 * n):
        epoch, done = divmod(position, n)
        read = set(sampler.permutation(epoch)[:done].tolist())
        expected = [s.name for s in ds.shards if set(range(s.start, s.stop)) <= read]
        assert consumed_shards(ds, sampler, position) == expected
    almost = consumed_shards(ds, sampler, n - 1)
    assert len(almost) == len(ds.shards) - 1
    assert ds.shard_of(int(sampler.permutation(0)[-1])) not in almost


def test_sample_seed_is_a_stable_63_bit_function_of_seed_and_position() -> None:
    seeds = [sample_seed(7, position) for position in range(1000)]
    assert all(0 <= s < 2**63 for s in seeds) and len(set(seeds)) == 1000
    assert sample_seed(7, 5) == seeds[5]
    assert sample_seed(8, 5) != seeds[5]
