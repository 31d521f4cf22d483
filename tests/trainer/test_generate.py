"""Test-time compute: KV-cached decoding and the adaptive-compute exit of `generate`, and
`evaluate` at several depths."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.trainer.training_runs import run_cli
from trainer.checkpoint import CheckpointConfig, CheckpointStore
from trainer.generate import decode
from trainer.model import KVCache, RecurrentLM, model_config
from trainer.rundir import RunDir

TINY = model_config("tiny")


@pytest.fixture
def model() -> RecurrentLM:
    torch.manual_seed(0)
    model = RecurrentLM(TINY).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-zero qk bias, non-unit norms
            p.add_(torch.randn_like(p) * 0.02)
    return model


@torch.no_grad()
def test_cached_decoding_gives_the_logits_of_the_full_forward(model: RecurrentLM) -> None:
    """Prefill 5 positions, then one position at a time through the per-iteration caches."""
    t, depth, prefill = 12, 3, 5
    ids = torch.randint(0, TINY.vocab_size, (1, t), generator=torch.Generator().manual_seed(1))
    s0 = model.initial_state(torch.empty(1, t, TINY.d_model), state_seeds=[7])
    full = model(ids, num_steps=depth, state=s0).logits

    cache = KVCache()
    pieces = [(0, prefill)] + [(p, 1) for p in range(prefill, t)]
    for start, n in pieces:
        e = model.embed(ids[:, start : start + n], start, cache)
        s = s0[:, start : start + n]
        for iteration in range(depth):
            s = model.core_step(s, e, n, start, cache, iteration)
        got = model.head(s, start, cache)
        torch.testing.assert_close(got, full[:, start : start + n], rtol=1e-5, atol=1e-5)
    # prelude, coda and every (iteration, core block) have their own keys, all t positions long
    assert len(cache.keys) == TINY.n_prelude + TINY.n_coda + depth * TINY.n_core
    assert {cache.length(layer) for layer in cache.keys} == {t}


def test_exit_threshold_sets_the_depth_each_token_uses(model: RecurrentLM) -> None:
    prompt = [5, 17, 42, 99]
    fixed, depths = decode(model, prompt, depth=8, max_new_tokens=6)
    assert depths == [8] * 6
    # ε = 0 never exits: the same tokens as without the exit
    assert decode(model, prompt, depth=8, max_new_tokens=6, exit_threshold=0.0) == (
        fixed,
        depths,
    )
    # a huge ε exits after one iteration for every token but the prompt's
    _, shallow = decode(model, prompt, depth=8, max_new_tokens=6, exit_threshold=1e9)
    assert shallow == [8, 1, 1, 1, 1, 1]
    # in between: the relative change of the state decides, per token
    changes = []
    for eps in (0.5, 0.2, 0.05, 0.01):
        tokens, used = decode(model, prompt, depth=8, max_new_tokens=6, exit_threshold=eps)
        assert len(tokens) == 6 and all(1 <= u <= 8 for u in used)
        changes.append(sum(used))
    assert changes == sorted(changes), "a smaller ε never uses fewer iterations"
    # deterministic for a seed
    again = decode(model, prompt, depth=8, max_new_tokens=6, exit_threshold=0.05)
    assert again == decode(model, prompt, depth=8, max_new_tokens=6, exit_threshold=0.05)


@pytest.fixture
def checkpoint(tmp_path: Path, prepared_data: Path) -> Path:
    torch.manual_seed(0)
    run = RunDir(tmp_path / "run").create()
    config = {"model": vars(TINY), "data": {"path": str(prepared_data)}}
    state = {"model": RecurrentLM(TINY).state_dict(), "optimizer": {}, "progress": {"step": 1}}
    assert CheckpointStore(run, CheckpointConfig(), 0, 1).save(1, {**state, "config": config})
    return run.checkpoint_path(1)


@pytest.mark.integration
def test_generate_cli_reports_the_mean_depth(checkpoint: Path) -> None:
    args = ["generate", str(checkpoint), "--prompt", "The module", "--depth", "4"]
    result = run_cli(*args, "--max-new-tokens", "5", "--exit-threshold", "1e9")
    assert result.returncode == 0, result.stderr
    assert "mean depth 1.60 of at most 4 over 5 tokens" in result.stderr  # (4 + 4·1) / 5
    assert run_cli(*args, "--exit-threshold", "-1").stderr.startswith("error: ")


@pytest.mark.integration
def test_evaluate_reports_perplexity_per_depth_as_json_with_a_plot(
    checkpoint: Path, tmp_path: Path
) -> None:
    plot = tmp_path / "depth.png"
    args = ["evaluate", str(checkpoint), "--depths", "1,2,4", "--batches", "1", "--batch-size", "4"]
    result = run_cli(*args, "--json", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert list(report["depths"]) == ["1", "2", "4"] and report["split"] == "val"
    for values in report["depths"].values():
        assert values["perplexity"] == pytest.approx(math.exp(values["loss"]))
        assert 1 < values["perplexity"] < 2 * TINY.vocab_size  # an untrained model: near uniform
    assert report["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = run_cli("evaluate", str(checkpoint), "--depths", "0,4")
    assert bad.returncode != 0 and bad.stderr.startswith("error: ") and "--depths" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
