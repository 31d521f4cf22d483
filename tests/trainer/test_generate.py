"""KV-cached decoding and the adaptive-compute exit of `generate`."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.training_runs import run_cli
from trainer.generate import decode
from trainer.model import KVCache, RecurrentLM, model_config

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


def test_generate_cli_reports_the_mean_depth(tmp_path, prepared_data) -> None:
    from trainer.checkpoint import CheckpointConfig, CheckpointStore
    from trainer.rundir import RunDir

    model = RecurrentLM(TINY)
    run = RunDir(tmp_path / "run").create()
    config = {"model": vars(TINY) | {}, "data": {"path": str(prepared_data)}}
    state = {"model": model.state_dict(), "optimizer": {}, "progress": {"step": 1}}
    assert CheckpointStore(run, CheckpointConfig(), 0, 1).save(1, {**state, "config": config})
    args = ["generate", str(run.checkpoint_path(1)), "--prompt", "The module", "--depth", "4"]
    result = run_cli(*args, "--max-new-tokens", "5", "--exit-threshold", "1e9")
    assert result.returncode == 0, result.stderr
    assert "mean depth 1.60 of at most 4 over 5 tokens" in result.stderr  # (4 + 4·1) / 5
    assert run_cli(*args, "--exit-threshold", "-1").stderr.startswith("error: ")
