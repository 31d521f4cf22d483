"""The depth-recurrent model: shapes, truncated backprop, depth sampling, seeding, configs."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainer.errors import ConfigError
from trainer.model import (
    PRESETS,
    ModelConfig,
    RecurrentLM,
    apply_rope,
    linear_cross_entropy,
    model_config,
    rope_cache,
    sample_recurrence,
)

TINY = model_config("tiny")


@pytest.fixture
def model() -> RecurrentLM:
    torch.manual_seed(0)
    return RecurrentLM(TINY)


def batch(b: int = 2, t: int = 16) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (b, t), generator=torch.Generator().manual_seed(1))


def test_shapes_and_defaults(model: RecurrentLM) -> None:
    ids = batch(3, 20)
    out = model(ids)
    assert out.logits.shape == (3, 20, TINY.vocab_size)
    assert out.loss is None
    assert out.num_steps == TINY.mean_recurrence
    out = model(ids, labels=ids, num_steps=7)
    assert out.num_steps == 7
    assert out.loss.shape == () and out.loss.dtype == torch.float32
    # freshly initialised logits are nearly uniform
    assert abs(out.loss.item() - np.log(TINY.vocab_size)) < 0.5


def test_bf16_autocast_keeps_fp32_loss(model: RecurrentLM) -> None:
    ids = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids, num_steps=2)
        assert model(ids, num_steps=2).logits.dtype == torch.bfloat16
    assert out.logits is None  # the loss never materialises all logits
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    assert model.adapter.weight.grad.dtype == torch.float32


def iterations_reached_by_gradient(model: RecurrentLM, num_steps: int, backprop_depth: int):
    """(iterations run, iterations whose adapter output received a gradient in backward)."""
    ran, reached = [], []

    def on_adapter_output(module, inputs, output):
        index = len(ran)
        ran.append(index)
        if output.requires_grad:
            output.register_hook(lambda grad: reached.append(index))

    handle = model.adapter.register_forward_hook(on_adapter_output)
    try:
        ids = batch()
        model(ids, labels=ids, num_steps=num_steps, backprop_depth=backprop_depth).loss.backward()
    finally:
        handle.remove()
    return ran, sorted(reached)


def test_truncated_backprop_reaches_only_the_last_k_iterations(model: RecurrentLM) -> None:
    ran, reached = iterations_reached_by_gradient(model, num_steps=6, backprop_depth=2)
    assert ran == [0, 1, 2, 3, 4, 5]
    assert reached == [4, 5]


def test_all_iterations_get_gradient_when_depth_within_backprop(model: RecurrentLM) -> None:
    ran, reached = iterations_reached_by_gradient(model, num_steps=3, backprop_depth=8)
    assert ran == reached == [0, 1, 2]


def test_no_grad_iterations_still_shape_the_output(model: RecurrentLM) -> None:
    # The r−k forward-only iterations must feed the state, not be skipped.
    ids = batch()
    shallow = model(ids, num_steps=2, backprop_depth=2, state_seeds=[1, 2]).logits
    deep = model(ids, num_steps=6, backprop_depth=2, state_seeds=[1, 2]).logits
    assert not torch.allclose(shallow, deep)


def train_step(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """(loss, grads, number of tensors saved for backward) of one step from a fixed init."""
    torch.manual_seed(0)
    model = RecurrentLM(replace(TINY, activation_checkpointing=checkpointing))
    ids = batch()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(ids, labels=ids, num_steps=4, backprop_depth=3, state_seeds=[5, 6]).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, len(saved)


def test_activation_checkpointing_gives_identical_loss_and_grads() -> None:
    loss_a, grads_a, saved_a = train_step(checkpointing=False)
    loss_b, grads_b, saved_b = train_step(checkpointing=True)
    assert saved_b < saved_a / 2  # checkpointing really dropped the core's activations
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], msg=name)


def test_state_seeds_make_batch_equal_to_per_sample_forwards(model: RecurrentLM) -> None:
    ids = batch(3)
    seeds = [11, 12, 13]
    whole = model(ids, num_steps=3, state_seeds=seeds).logits
    parts = torch.cat(
        [model(ids[i : i + 1], num_steps=3, state_seeds=[seeds[i]]).logits for i in range(3)]
    )
    torch.testing.assert_close(whole, parts, rtol=1e-5, atol=1e-5)
    # reordering the batch reorders the outputs: a sample's state follows its seed
    swapped = model(ids[[2, 0, 1]], num_steps=3, state_seeds=[13, 11, 12]).logits
    torch.testing.assert_close(swapped, whole[[2, 0, 1]], rtol=1e-5, atol=1e-5)


def test_state_seeds_are_deterministic_and_global_rng_free(model: RecurrentLM) -> None:
    ids = batch()
    a = model(ids, state_seeds=[1, 2]).logits
    torch.manual_seed(999)  # a different global RNG state must not matter
    b = model(ids, state_seeds=[1, 2]).logits
    c = model(ids, state_seeds=[1, 3]).logits
    assert torch.equal(a, b)
    assert torch.equal(a[0], c[0]) and not torch.allclose(a[1], c[1])
    # without seeds the state is drawn fresh each forward
    assert not torch.equal(model(ids).logits, model(ids).logits)


def test_initial_state_distribution(model: RecurrentLM) -> None:
    like = torch.empty(4, 64, TINY.d_model)
    s = model.initial_state(like).double()
    sigma = np.sqrt(2 / (5 * TINY.d_model)) * np.sqrt(TINY.d_model)
    assert s.abs().max() <= 3 * sigma * (1 + 1e-6)
    # a normal truncated at ±3σ has std 0.9866σ
    assert s.std().item() == pytest.approx(0.9866 * sigma, rel=0.03)


def test_depth_sampler_matches_distribution() -> None:
    draws = np.array([sample_recurrence(seed=0, step=s, mean=32) for s in range(20_000)])
    assert draws.min() >= 1
    assert 32.6 < draws.mean() < 33.4  # E[r] = r̄ + 1
    assert 28 <= np.median(draws) <= 30
    assert 88 <= np.percentile(draws, 99) <= 100


def test_depth_sampler_is_a_function_of_seed_and_step() -> None:
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()
    first = [sample_recurrence(7, step, 32) for step in range(50)]
    assert first == [sample_recurrence(7, step, 32) for step in range(50)]
    assert len(set(first)) > 10
    assert first != [sample_recurrence(8, step, 32) for step in range(50)]
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.random.get_state()[1].tolist() == np_state[1].tolist()


def test_huginn_parameter_count_on_meta_device() -> None:
    with torch.device("meta"):
        model = RecurrentLM(PRESETS["huginn-3.5b"])
    assert all(p.is_meta for p in model.parameters())
    counts = model.param_counts()
    # The published model's modules: 8 blocks × (4d² + 3dh + 4d + 2d) + adapter 2d² + tied
    # embedding V·d + one ln_f d, with d=5280, h=17920, V=65536.
    assert counts.total == 3_564_976_800
    assert counts.embedding == 65536 * 5280
    assert counts.adapter == 2 * 5280 * 5280
    assert counts.norm == 5280
    assert counts.core == 2 * counts.prelude == 2 * counts.coda
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert model.prelude[0].attn.qk_bias.shape == (2, 1, 55, 96)


def test_meta_model_materialises_with_init_weights() -> None:
    with torch.device("meta"):
        model = RecurrentLM(TINY)
    model.to_empty(device="cpu")
    model.init_weights()
    ids = batch()
    loss = model(ids, labels=ids, num_steps=2).loss
    assert torch.isfinite(loss)
    reference = RecurrentLM(TINY)
    torch.testing.assert_close(model.rope_cos, reference.rope_cos)


@pytest.mark.parametrize("ignored", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_linear_cross_entropy_equals_the_plain_one(
    dtype: torch.dtype, ignored: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 16, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 50, (2, 37), generator=gen)
    if ignored:
        labels[0, :5] = -100  # ignored positions
    loss = linear_cross_entropy(x, weight, labels, chunk=8)  # 10 chunks, the last one short
    (loss * 3).backward()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = weight.detach().clone().requires_grad_()
    logits = F.linear(x_ref, w_ref.to(dtype)).float()
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    (ref * 3).backward()
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}
    torch.testing.assert_close(loss, ref, **tol)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    torch.testing.assert_close(weight.grad, w_ref.grad, **tol)
    assert weight.grad.dtype == torch.float32 and x.grad.dtype == dtype
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(x, weight, labels, chunk=8), ref, **tol)


def test_rope_rotates_interleaved_pairs_in_fp32() -> None:
    cos, sin = rope_cache(head_dim=4, seq_len=3, base=100.0)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (3, 2)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).expand(1, 3, 4).contiguous()
    out = apply_rope(x, cos, sin)
    for t in range(3):
        for i, angle in enumerate((t * 1.0, t / 10.0)):  # base^(−2i/4) = 1, 0.1
            a, b = x[0, t, 2 * i].item(), x[0, t, 2 * i + 1].item()
            expected = (
                a * np.cos(angle) - b * np.sin(angle),
                b * np.cos(angle) + a * np.sin(angle),
            )
            assert out[0, t, 2 * i : 2 * i + 2].tolist() == pytest.approx(expected, rel=1e-6)
    # bf16 input: rotated in fp32, rounded once at the end
    y = torch.randn(2, 3, 4).to(torch.bfloat16)
    assert torch.equal(apply_rope(y, cos, sin), apply_rope(y.float(), cos, sin).to(torch.bfloat16))


def rope_by_real_formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation as the paper writes it, on the even and odd halves (the old implementation)."""
    shape = (x.shape[1],) + (1,) * (x.dim() - 3) + (x.shape[-1] // 2,)
    cos, sin = cos.view(shape).to(torch.float64), sin.view(shape).to(torch.float64)
    even, odd = x.to(torch.float64).unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_complex_rope_equals_the_real_formula_with_gradients(dtype: torch.dtype) -> None:
    cos, sin = rope_cache(head_dim=16, seq_len=12, base=10000.0)
    gen = torch.Generator().manual_seed(0)
    # (B, T, 2, heads, head_dim) sliced like q, k out of qkv: not contiguous
    qkv = torch.randn(2, 12, 3, 4, 16, generator=gen, dtype=dtype, requires_grad=True)
    x = qkv[:, :, :2]
    out = apply_rope(x, cos, sin)
    ref = rope_by_real_formula(x, cos, sin)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 0}
    assert out.dtype == dtype
    torch.testing.assert_close(out.to(torch.float64), ref, **tol)
    g = torch.randn(out.shape, generator=gen, dtype=dtype)
    (grad,) = torch.autograd.grad(out, qkv, g)
    (grad_ref,) = torch.autograd.grad(ref, qkv, g.to(torch.float64))
    torch.testing.assert_close(grad.to(torch.float64), grad_ref.to(torch.float64), **tol)


@pytest.mark.integration
def test_compiled_rope_real_formula_equals_the_eager_complex_one() -> None:
    cos, sin = rope_cache(head_dim=16, seq_len=12, base=10000.0)
    x = torch.randn(2, 12, 2, 4, 16, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(apply_rope, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, cos, sin), apply_rope(x, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_rope_refuses_tables_narrower_than_fp32(compiled: bool) -> None:
    """A cast of the tables to bf16 (FSDP's cast_forward_inputs, `model.to(bfloat16)`) must never
    pass silently: eager, and traced by dynamo (the real formula), it raises. The matrix in
    test_production_matrix.py trains every strategy with the real compiler behind this check."""
    cos, sin = rope_cache(head_dim=16, seq_len=12, base=10000.0)
    x = torch.randn(2, 12, 2, 4, 16, generator=torch.Generator().manual_seed(0))
    rope = torch.compile(apply_rope, backend="eager") if compiled else apply_rope
    assert rope(x.bfloat16(), cos, sin).dtype == torch.bfloat16  # bf16 activations are fine
    with pytest.raises(RuntimeError, match=r"RoPE tables arrived in torch\.bfloat16"):
        rope(x, cos.bfloat16(), sin.bfloat16())


def test_bf16_weights_keep_the_residual_stream_and_rope_in_fp32(model: RecurrentLM) -> None:
    """Under FSDP the blocks compute with bf16 copies of the weights (MixedPrecisionPolicy's
    param_dtype) instead of autocast's: the stream still starts fp32 at the embedding and the
    loss equals the one of fp32 weights under the same bf16 autocast up to the weights' rounding."""
    ids = batch(2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model(ids, labels=ids, num_steps=2, state_seeds=[0, 1]).loss
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.embed_tokens(ids).dtype == torch.float32
        loss = model(ids, labels=ids, num_steps=2, state_seeds=[0, 1]).loss
    assert model.rope_cos.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=5e-4, atol=0)  # measured 8e-5


def test_qk_bias_add_promotes_without_an_fp32_copy_and_reaches_fp32_bias(model) -> None:
    attn = model.core[0].attn
    with torch.no_grad():
        attn.qk_bias.normal_()
    x = torch.randn(2, 8, TINY.d_model, generator=torch.Generator().manual_seed(0))
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        qkv = attn.qkv(x).view(2, 8, 3, attn.n_heads, attn.head_dim)
    promoted = qkv[:, :, :2] + attn.qk_bias.transpose(0, 1)
    assert promoted.dtype == torch.float32
    assert torch.equal(promoted, qkv[:, :, :2].float() + attn.qk_bias.transpose(0, 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn(x, cos, sin).float().square().sum().backward()
    assert attn.qk_bias.grad.dtype == torch.float32 and attn.qk_bias.grad.abs().sum() > 0
    assert attn.qkv.weight.grad.dtype == torch.float32


def test_bf16_autocast_casts_each_weight_once_per_step_however_deep(model: RecurrentLM) -> None:
    """Autocast caches the bf16 copy of a leaf fp32 weight for the whole forward, no-grad
    iterations included, so looping the core r times does not repeat the weight casts."""
    from torch.utils._python_dispatch import TorchDispatchMode

    weights = {id(p) for p in model.parameters() if p.dim() == 2}
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}

    class CountWeightCasts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in shapes:
                self.count += (
                    kwargs.get("dtype") == torch.bfloat16 and args[0].dtype == torch.float32
                )
            return func(*args, **kwargs)

    ids = batch()
    counts = []
    for num_steps in (1, 6):
        with torch.autocast("cpu", dtype=torch.bfloat16), CountWeightCasts() as mode:
            model(ids, labels=ids, num_steps=num_steps, backprop_depth=1)
        counts.append(mode.count)
    assert 0 < counts[0] == counts[1] <= len(weights)


def test_qk_bias_starts_at_zero_and_shifts_attention(model: RecurrentLM) -> None:
    biases = [block.attn.qk_bias for block in (*model.prelude, *model.core, *model.coda)]
    assert all(torch.equal(b, torch.zeros_like(b)) for b in biases)
    ids = batch()
    before = model(ids, num_steps=2, state_seeds=[1, 2]).logits
    with torch.no_grad():
        model.core[0].attn.qk_bias[1].normal_()  # k bias of the first core block
    after = model(ids, num_steps=2, state_seeds=[1, 2])
    assert not torch.allclose(before, after.logits)
    model(ids, labels=ids, num_steps=2).loss.backward()
    assert model.core[0].attn.qk_bias.grad.abs().sum() > 0


def test_one_final_norm_is_applied_twice(model: RecurrentLM) -> None:
    calls = []
    model.ln_f.register_forward_hook(lambda module, inputs, output: calls.append(1))
    model(batch(), num_steps=2)
    assert len(calls) == 2
    assert not any("core_norm" in n or "final_norm" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"n_heads": 3}, "n_heads=3 must divide"),
        ({"d_model": 0}, "d_model must be > 0"),
        ({"n_heads": 64}, "must be even for RoPE"),
        ({"mean_recurrence": 0}, "mean_recurrence"),
        ({"backprop_depth": -1}, "backprop_depth"),
        ({"vocab_size": "4096"}, "vocab_size must be int"),
        ({"compile": 1}, "compile must be bool"),
        ({"n_core": 2.0}, "n_core must be int"),
        ({"no_such_field": 1}, "unknown model field"),
    ],
)
def test_invalid_config_is_a_one_line_config_error(overrides: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        model_config("tiny", **overrides)
    assert "\n" not in str(info.value)


def test_unknown_preset_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=re.escape("tiny, small, 1b, huginn-3.5b")):
        model_config("huge")


def test_presets_are_valid_and_overrides_apply() -> None:
    for cfg in PRESETS.values():
        cfg.validate()
    cfg = model_config("small", mean_recurrence=8)
    assert isinstance(cfg, ModelConfig) and cfg.mean_recurrence == 8
    assert PRESETS["small"].mean_recurrence == 4  # presets are not mutated


def test_too_long_input_is_a_config_error(model: RecurrentLM) -> None:
    with pytest.raises(ConfigError, match="max_seq_len"):
        model(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))
