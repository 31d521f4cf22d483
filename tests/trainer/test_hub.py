"""Exports as their real consumers load them: transformers' Auto classes (through the modelling
code the export ships), `model.generate`, and the published Huginn code's config contract; and
import-hf of what transformers' own save_pretrained writes."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

from tests.trainer.hub_model import (
    FIXTURE,
    IDS,
    NUM_STEPS,
    formula_model,
    initial_state,
    perturbed_tiny,
    save_checkpoint,
)
from trainer.export import export_checkpoint, import_hf, load_exported
from trainer.generate import decode
from trainer.model import RecurrentLM


@pytest.fixture(scope="module")
def exported(
    tmp_path_factory: pytest.TempPathFactory, prepared_data: Path
) -> tuple[Path, RecurrentLM]:
    """An export of a tiny model with perturbed weights, whose run's dataset has a tokenizer."""
    model = perturbed_tiny(seed=2, scale=0.05)
    root = tmp_path_factory.mktemp("hub")
    ckpt = save_checkpoint(model, root / "run", 3, prepared_data)
    return export_checkpoint(ckpt, root / "export"), model


def load_auto(path: Path) -> PreTrainedModel:
    model, info = AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, output_loading_info=True
    )
    assert info["missing_keys"] == [] and info["unexpected_keys"] == [], info
    return model.eval()


@pytest.mark.parametrize("depth", [1, 4])
def test_auto_model_logits_equal_the_trainers_in_float64(
    exported: tuple[Path, RecurrentLM], depth: int
) -> None:
    out, original = exported
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert (config.model_type, config.hidden_size, config.num_attention_heads) == (
        "huginn_raven",
        64,
        4,
    )
    hub, ours = load_auto(out).double(), RecurrentLM(original.cfg).double().eval()
    ours.load_state_dict(original.state_dict())
    ids = torch.randint(0, 4096, (2, 20), generator=torch.Generator().manual_seed(0))
    state = torch.randn(2, 20, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = hub(ids, num_steps=depth, input_states=state).logits
        want = ours(ids, num_steps=depth, state=state).logits
    assert got.dtype == torch.float64 and want.abs().max() > 0.5
    assert (got - want).abs().max() <= 1e-6  # measured: 0


def test_auto_tokenizer_and_generate_at_a_chosen_depth(exported: tuple[Path, RecurrentLM]) -> None:
    out, _ = exported
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("The module", return_tensors="pt")
    assert (
        prompt["input_ids"][0].tolist()
        == Tokenizer.from_file(str(out / "tokenizer.json")).encode("The module").ids
    )
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    hub, ours = load_auto(out), load_exported(out)
    assert hub.generation_config.eos_token_id == 0
    for depth in (1, 3):
        # The trainer's decoder draws each forward's start state from a generator seeded
        # seed + 1; the Hub model from torch's global one: the same draws, the same tokens.
        torch.manual_seed(1)
        generated = hub.generate(**prompt, max_new_tokens=5, num_steps=depth, do_sample=False)
        new, _ = decode(ours, prompt["input_ids"][0].tolist(), depth, 5, seed=0)
        assert generated[0, prompt["input_ids"].shape[1] :].tolist() == new, depth


def test_left_padded_batch_matches_each_prompt_alone(exported: tuple[Path, RecurrentLM]) -> None:
    out, _ = exported
    hub = load_auto(out).double()
    long, short = [7, 300, 21, 5, 99], [42, 8]
    ids = torch.tensor([long, [0] * 3 + short])
    mask = torch.tensor([[1] * 5, [0] * 3 + [1] * 2])
    state = torch.randn(2, 5, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        batch = hub(ids, attention_mask=mask, num_steps=3, input_states=state).logits
        alone = hub(torch.tensor([short]), num_steps=3, input_states=state[1:, 3:]).logits
    assert (batch[1, 3:] - alone[0]).abs().max() < 1e-12


def _published_config_class() -> type[PretrainedConfig]:
    """A config class with the published RavenConfig's constructor contract, as recorded from
    the published code (fixtures/raven_reference.json): its named parameters with their
    defaults, its attribute_map, and `tie_word_embeddings`, which it passes to transformers
    itself (a config.json that also carries that key raised "got multiple values")."""
    record = json.loads(FIXTURE.read_text())
    parameters: dict[str, Any] = record["config_parameters"]

    class PublishedContract(PretrainedConfig):
        model_type = record["model_type"]
        attribute_map = record["attribute_map"]

        def __init__(self, **kwargs: Any) -> None:
            named = {name: kwargs.pop(name, default) for name, default in parameters.items()}
            self.__dict__.update(named)
            passed = {name: named["tie_embeddings"] for name in record["passes_to_transformers"]}
            super().__init__(**passed, **kwargs)

    return PublishedContract


def test_the_published_config_contract_reads_an_export(
    exported: tuple[Path, RecurrentLM],
) -> None:
    out, original = exported
    config = _published_config_class().from_pretrained(out)
    cfg = original.cfg
    assert (config.n_embd, config.n_heads, config.num_attention_heads) == (64, 4, 4)
    assert (config.n_layers_in_prelude, config.n_layers_in_recurrent_block) == (
        cfg.n_prelude,
        cfg.n_core,
    )
    assert (config.n_layers_in_coda, config.intermediate_size) == (cfg.n_coda, cfg.mlp_hidden)
    assert (config.block_size, config.rope_base, config.norm_eps) == (
        cfg.max_seq_len,
        cfg.rope_base,
        cfg.norm_eps,
    )
    assert (config.padded_vocab_size, config.num_key_value_heads) == (cfg.vocab_size, 4)
    assert config.tie_embeddings is True and config.qk_bias is True and config.bias is False
    assert config.tie_word_embeddings is True


def test_an_export_has_the_tensors_the_published_model_loads_and_its_logits(
    tmp_path: Path,
) -> None:
    """The published RavenForCausalLM loaded an export of formula_model() with nothing missing
    or unexpected and computed these logits (fixtures/raven_reference.json, float32); the same
    export, loaded by the Auto classes and by the trainer, gives them again."""
    record = json.loads(FIXTURE.read_text())
    assert record["loading_info"]["missing_keys"] == record["loading_info"]["unexpected_keys"] == []
    out = export_checkpoint(
        save_checkpoint(formula_model(), tmp_path / "run", 1, None), tmp_path / "x"
    )
    hub = load_auto(out)
    assert sorted(hub.state_dict()) == record["state_dict_keys"]
    raw = base64.b64decode(record["logits_float32"])
    published = torch.from_numpy(
        np.frombuffer(raw, np.float32).reshape(record["logits_shape"]).copy()
    )
    ids, state = torch.tensor(IDS), initial_state()
    with torch.no_grad():
        from_hub = hub(ids, num_steps=NUM_STEPS, input_states=state).logits
        from_trainer = load_exported(out)(ids, num_steps=NUM_STEPS, state=state).logits
    assert published.abs().max() > 0.2  # not trivially small
    assert (from_hub - published).abs().max() <= 1e-6  # measured: 0
    assert (from_trainer - published).abs().max() <= 1e-6  # measured: 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_import_reads_what_transformers_save_pretrained_writes(
    exported: tuple[Path, RecurrentLM], tmp_path: Path, dtype: torch.dtype
) -> None:
    """This project's modelling class, built from a RavenConfig of its own defaults and saved by
    transformers (config.json with `dtype`, sharded safetensors with an index), imports to the
    same logits."""
    out, _ = exported
    config_class = type(AutoConfig.from_pretrained(out, trust_remote_code=True))
    model_class = type(load_auto(out))
    config = config_class(
        n_embd=32, n_heads=2, n_layers_in_prelude=1, n_layers_in_recurrent_block=1,
        n_layers_in_coda=1, intermediate_size=48, vocab_size=512, block_size=64,
        mean_recurrence=3, mean_backprop_depth=2,
    )  # fmt: skip
    torch.manual_seed(5)
    saved = model_class(config).to(dtype).eval()
    saved.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (
        written["dtype"] == str(dtype).removeprefix("torch.") and "transformers_version" in written
    )
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()

    notes: list[str] = []
    checkpoint = import_hf(tmp_path / "hf", tmp_path / "run", notes=notes)
    assert ("stored as bfloat16" in " ".join(notes)) is (dtype == torch.bfloat16), notes
    imported = load_exported(export_checkpoint(checkpoint, tmp_path / "again"))
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    state = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = saved.float()(ids, num_steps=3, input_states=state).logits
        got = imported(ids, num_steps=3, state=state).logits
    assert (got - want).abs().max() <= 1e-6
