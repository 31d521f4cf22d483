"""Export to safetensors and back, and text generation from checkpoints and exports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from tests.trainer.hub_model import perturbed_tiny, save_checkpoint
from tests.trainer.training_runs import run_cli, tiny_config
from trainer.checkpoint import MODEL_FILE
from trainer.errors import UserError
from trainer.export import export_checkpoint, import_hf, load_any, load_exported
from trainer.generate import generate_text
from trainer.model import PRESETS, RecurrentLM
from trainer.rundir import ExitCode, RunDir
from trainer.train import train


@pytest.fixture(scope="module")
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory, prepared_data: Path
) -> tuple[Path, RecurrentLM]:
    """A checkpoint of a tiny model with perturbed weights, saved the way the loop saves it."""
    model = perturbed_tiny(seed=1, scale=0.01)
    return save_checkpoint(model, tmp_path_factory.mktemp("run"), 7, prepared_data), model


def logits(model: RecurrentLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, num_steps=3, state_seeds=list(range(len(ids)))).logits


def some_ids(vocab: int, b: int = 2, t: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(0))


def test_export_writes_the_published_layout_and_imports_to_identical_logits(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path
) -> None:
    ckpt, original = checkpoint
    out = export_checkpoint(ckpt, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "configuration_raven.py",
        "generation_config.json",
        "model.safetensors",
        "modeling_raven.py",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "huginn_raven"
    assert config["architectures"] == ["RavenForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_raven.RavenForCausalLM"
    # the published RavenConfig passes tie_word_embeddings to transformers itself
    assert "tie_word_embeddings" not in config
    cfg = original.cfg
    assert (config["n_embd"], config["n_heads"], config["intermediate_size"]) == (64, 4, 176)
    assert config["n_layers_in_prelude"] == cfg.n_prelude and config["n_layers"] == 4
    assert config["n_layers_in_recurrent_block"] == cfg.n_core
    assert config["qk_bias"] is True and config["tie_embeddings"] is True
    assert config["block_size"] == cfg.max_seq_len and config["rope_base"] == cfg.rope_base
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("freqs_cis").shape == (1, cfg.max_seq_len, 1, cfg.head_dim // 2, 2)
    assert {
        "transformer.wte.weight",
        "transformer.adapter.weight",
        "transformer.ln_f.weight",
        "transformer.prelude.0.attn.Wqkv.weight",
        "transformer.prelude.0.attn.qk_bias",
        "transformer.core_block.1.mlp.fc.weight",
        "transformer.coda.0.norm_4.weight",
    } <= names
    assert "lm_head.weight" not in names  # tied, stored once
    assert len(names) == len(original.state_dict()) + 1  # + freqs_cis

    assert torch.equal(
        logits(load_exported(out), some_ids(cfg.vocab_size)),
        logits(original, some_ids(cfg.vocab_size)),
    )


def test_sharded_export_with_index_imports_to_identical_logits(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path
) -> None:
    ckpt, original = checkpoint
    out = export_checkpoint(ckpt, tmp_path / "sharded", max_shard_bytes=400_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert not (out / "model.safetensors").exists()
    ids = some_ids(original.cfg.vocab_size)
    assert torch.equal(logits(load_exported(out), ids), logits(original, ids))


@pytest.mark.integration
def test_import_hf_makes_a_checkpoint_that_trains_and_generates(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path, prepared_data: Path
) -> None:
    ckpt, original = checkpoint
    out = export_checkpoint(ckpt, tmp_path / "export")
    result = run_cli("import-hf", str(out), str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    imported = tmp_path / "run" / "checkpoints" / "step-00000000"
    ids = some_ids(original.cfg.vocab_size)
    assert torch.equal(
        logits(load_exported(export_checkpoint(imported, tmp_path / "again")), ids),
        logits(original, ids),
    )
    assert (
        generate_text(imported, "The module", depth=2, max_new_tokens=4).text
        == generate_text(ckpt, "The module", depth=2, max_new_tokens=4).text
    )
    # `train` resumes from it: weights imported, optimizer and schedule fresh, steps 1 and 2.
    cfg = tiny_config(prepared_data, tmp_path / "run", "train.steps=2")
    assert train(cfg) == ExitCode.OK
    records = [r for r in RunDir(tmp_path / "run").read_metrics() if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2]
    start = next(e for e in RunDir(tmp_path / "run").read_events() if e["event"] == "start")
    assert start["resumed_from"].endswith("step-00000000")
    # imported as a sharded checkpoint (weights only), a checkpoint.format=sharded run resumes
    # from it and trains the same steps to the same losses
    import_hf(out, tmp_path / "sharded", checkpoint_format="sharded")
    cfg = tiny_config(prepared_data, tmp_path / "sharded", "train.steps=2")
    cfg.checkpoint.format = "sharded"
    assert train(cfg) == ExitCode.OK
    sharded = [r for r in RunDir(tmp_path / "sharded").read_metrics() if r["kind"] == "train"]
    assert [r["loss"] for r in sharded] == [r["loss"] for r in records]


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"n_experts": 8}, "unknown config field 'n_experts'"),
        ({"qk_bias": False}, "qk_bias=False is not supported"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 must equal n_heads=4"),
        ({"model_type": "llama"}, "model_type 'llama'"),
        ({"num_attention_heads": 8}, "num_attention_heads=8 contradicts n_heads=4"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling="),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters="),
        ({"quantization_config": {"quant_method": "gptq"}}, "save them unquantized"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings=False is not supported"),
    ],
)
def test_import_rejects_what_it_does_not_know_in_one_line(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path, change: dict, fragment: str
) -> None:
    ckpt, _ = checkpoint
    out = export_checkpoint(ckpt, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError) as refused:
        import_hf(out, tmp_path / "run")
    assert fragment in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists(), "nothing is written for a config it cannot read"


@pytest.mark.integration
def test_import_refusal_is_one_line_from_the_cli(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path
) -> None:
    ckpt, _ = checkpoint
    out = export_checkpoint(ckpt, tmp_path / "export")
    os.truncate(out / "model.safetensors", (out / "model.safetensors").stat().st_size // 2)
    result = run_cli("import-hf", str(out), str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert f"{out / 'model.safetensors'} is not a readable safetensors file" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("size", [0, 10, 200])
def test_a_truncated_shard_is_named_in_one_line(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path, size: int
) -> None:
    ckpt, _ = checkpoint
    out = export_checkpoint(ckpt, tmp_path / "sharded", max_shard_bytes=400_000)
    shard = sorted(out.glob("model-*.safetensors"))[1]
    os.truncate(shard, size)
    with pytest.raises(UserError, match=f"^{shard} is not a readable safetensors file"):
        import_hf(out, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _published_style(config: dict) -> dict:
    """The names of the published raven_config_minimal.json: `num_attention_heads` (no n_heads),
    no rope_base (its config class defaults it), metadata of its own, an old transformers."""
    dropped = {"n_heads", "rope_base", "head_dim", "n_layers", "padded_vocab_size"}
    dropped |= {"effective_expected_depth", "init_values", "auto_map", "torch_dtype"}
    kept = {k: v for k, v in config.items() if k not in dropped}
    return kept | {
        "name": "nebel-raven-3.5b",
        "hf_config": {"org": "tomg-group-umd", "name": "nebel-raven-3.5b"},
        "torch_dtype": "bfloat16",
        "transformers_version": "4.28.1",
        "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig"},
    }


def _transformers_5(config: dict) -> dict:
    """What transformers 5 writes: `dtype`, and RoPE as rope_parameters."""
    kept = {k: v for k, v in config.items() if k not in ("torch_dtype", "rope_base")}
    rope = {"rope_type": "default", "rope_theta": config["rope_base"]}
    return kept | {"dtype": "float32", "transformers_version": "5.23.0", "rope_parameters": rope}


@pytest.mark.parametrize(
    ("rewrite", "note"),
    [
        (_published_style, "the published defaults apply: rope_base=50000.0"),
        (lambda c: {**c, "dtype": "float32", "transformers_version": "4.57.6"}, None),
        (_transformers_5, None),
        (lambda c: {**c, "temperature": 0.7, "max_length": 20, "use_cache": True}, "max_length"),
    ],
    ids=["published-config", "transformers-4.57", "transformers-5", "old-generation-fields"],
)
def test_import_accepts_what_the_ecosystem_writes(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path, rewrite, note: str | None
) -> None:
    ckpt, original = checkpoint
    out = export_checkpoint(ckpt, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(rewrite(config)))
    notes: list[str] = []
    imported = import_hf(out, tmp_path / "run", notes=notes)
    if note is None:
        assert notes == []
    else:
        assert note in " ".join(notes), notes
    ids = some_ids(original.cfg.vocab_size)
    assert torch.equal(logits(load_any(imported)[0], ids), logits(original, ids))


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_checkpoint_hub_checkpoint_round_trip_is_bit_identical(
    tmp_path: Path, prepared_data: Path, fmt: str
) -> None:
    """A checkpoint (full or sharded) → export → import-hf (the same format) → export: every
    float32 tensor bit-identical, the exported files byte-identical, the tokenizer carried."""
    torch.manual_seed(4)
    model = RecurrentLM(PRESETS["tiny"])
    original = save_checkpoint(model, tmp_path / "run", 5, prepared_data, fmt)
    first = export_checkpoint(original, tmp_path / "first")
    imported = import_hf(first, tmp_path / "imported", checkpoint_format=fmt)
    assert (imported / "dcp").is_dir() is (fmt == "sharded")
    back, _ = load_any(imported)
    for name, tensor in model.state_dict().items():
        assert back.state_dict()[name].dtype == torch.float32
        assert torch.equal(back.state_dict()[name], tensor), name
    second = export_checkpoint(imported, tmp_path / "second")
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    for file in first.iterdir():
        assert file.read_bytes() == (second / file.name).read_bytes(), file.name
    tokenizer = (prepared_data / "tokenizer.json").read_bytes()
    assert (tmp_path / "imported" / "tokenizer.json").read_bytes() == tokenizer


def test_logits_match_an_independent_float64_implementation_of_the_paper() -> None:
    """Huginn's forward pass written out in numpy float64, from the paper's equations and the
    published layout, against the model run in float64."""
    torch.manual_seed(3)
    model = RecurrentLM(PRESETS["tiny"])
    with torch.no_grad():
        for p in model.parameters():  # make every norm gain and qk bias matter
            p.add_(torch.randn_like(p) * 0.05)
    model = model.double().eval()
    cfg = model.cfg
    d, heads, hd, t, r, seed = cfg.d_model, cfg.n_heads, cfg.head_dim, 8, 3, 5
    ids = torch.randint(0, cfg.vocab_size, (1, t), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids, num_steps=r, state_seeds=[seed]).logits[0].numpy()

    w = {name: p.detach().numpy() for name, p in model.named_parameters()}

    def rms(x, gain):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * gain

    pos = np.arange(t)[:, None]
    theta = cfg.rope_base ** (-np.arange(0, hd, 2) / hd)  # one frequency per pair (2i, 2i+1)
    cos, sin = np.cos(pos * theta), np.sin(pos * theta)

    def rope(x):  # x: (t, heads, hd)
        a, b = x[..., 0::2], x[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, b * c + a * s
        return out

    def attention(x, p):
        q, k, v = (x @ w[p + "attn.qkv.weight"].T).reshape(t, 3, heads, hd).transpose(1, 0, 2, 3)
        bias = w[p + "attn.qk_bias"]  # (2, 1, heads, hd): q then k
        q, k = rope(q + bias[0]), rope(k + bias[1])
        scores = np.einsum("qhe,khe->hqk", q, k) / np.sqrt(hd)
        scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        y = np.einsum("hqk,khe->qhe", probs, v).reshape(t, d)
        return y @ w[p + "attn.proj.weight"].T

    def mlp(x, p):
        gate, up = np.split(x @ w[p + "mlp.gate_up.weight"].T, 2, axis=-1)
        return (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.proj.weight"].T

    def block(x, p):
        x = rms(attention(rms(x, w[p + "n1.weight"]), p) + x, w[p + "n2.weight"])
        return rms(mlp(rms(x, w[p + "n3.weight"]), p) + x, w[p + "n4.weight"])

    emb = w["embedding.weight"]
    x = emb[ids[0].numpy()] * np.sqrt(d)
    for i in range(cfg.n_prelude):
        x = block(x, f"prelude.{i}.")
    e = x
    # s₀ ~ TruncNormal(0, σ², ±3σ) · √d, σ = √(2/(5d)), drawn from the sample's seeded generator
    sigma = np.sqrt(2 / (5 * d))
    s0 = torch.empty(t, d)
    torch.nn.init.trunc_normal_(
        s0, std=sigma, a=-3 * sigma, b=3 * sigma, generator=torch.Generator().manual_seed(seed)
    )
    s = s0.double().numpy() * np.sqrt(d)
    for _ in range(r):
        s = np.concatenate([s, e], axis=-1) @ w["adapter.weight"].T
        for i in range(cfg.n_core):
            s = block(s, f"core.{i}.")
    x = rms(s, w["ln_f.weight"])
    for i in range(cfg.n_coda):
        x = block(x, f"coda.{i}.")
    want = rms(x, w["ln_f.weight"]) @ emb.T
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert np.abs(want).max() > 0.1  # not trivially small


@pytest.mark.integration
def test_generate_from_checkpoint_and_export_agree(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path
) -> None:
    ckpt, _ = checkpoint
    out = export_checkpoint(ckpt, tmp_path / "export")
    text = generate_text(ckpt, "The module", depth=2, max_new_tokens=6).text
    assert isinstance(text, str) and text
    assert generate_text(out, "The module", depth=2, max_new_tokens=6).text == text
    sampled = generate_text(out, "The module", depth=2, max_new_tokens=6, top_k=20, seed=3)
    assert sampled == generate_text(out, "The module", depth=2, max_new_tokens=6, top_k=20, seed=3)


def test_export_refuses_a_non_empty_target_and_a_damaged_checkpoint(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path
) -> None:
    ckpt, _ = checkpoint
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        export_checkpoint(ckpt, taken)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]

    damaged = tmp_path / "step-00000007"
    damaged.mkdir()
    for src in ckpt.iterdir():
        (damaged / src.name).write_bytes(src.read_bytes())
    os.truncate(damaged / MODEL_FILE, 10)
    with pytest.raises(UserError, match="not a usable checkpoint"):
        export_checkpoint(damaged, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="neither a checkpoint"):
        generate_text(tmp_path, "x", depth=1)


@pytest.mark.integration
def test_generate_with_an_empty_tokenizer_is_one_line(
    checkpoint: tuple[Path, RecurrentLM], tmp_path: Path
) -> None:
    ckpt, _ = checkpoint
    out = export_checkpoint(ckpt, tmp_path / "export")
    (out / "tokenizer.json").write_bytes(b"")
    result = run_cli("generate", str(out), "--prompt", "The module", "--max-new-tokens", "2")
    assert result.returncode == 3, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "tokenizer.json" in line and "--tokenizer" in line
    good = run_cli(
        "generate",
        str(out),
        "--prompt",
        "The",
        "--max-new-tokens",
        "2",
        "--tokenizer",
        str(ckpt.parent.parent / "missing.json"),
    )
    assert good.returncode != 0 and "Traceback" not in good.stderr
