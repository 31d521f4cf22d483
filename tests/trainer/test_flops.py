"""FLOPs accounting checked against hand arithmetic and against torch's own FLOP counter."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from clusterspec import vendors
from trainer import flops
from trainer.flops import flops_per_token, measure_gemm_flops, peak_flops
from trainer.model import RecurrentLM, model_config

TINY = model_config("tiny")  # d=64, mlp 176, prelude/core/coda 1/2/1, vocab 4096


def test_hand_computed_tiny_example() -> None:
    d, mlp, vocab, t = 64, 176, 4096, 16
    # qkv, out, gate/up, down, 4 norms, qk bias
    block = 3 * d * d + d * d + 2 * d * mlp + mlp * d + 4 * d + 2 * d
    adapter, final_norms = 2 * d * d, 2 * d  # one ln_f, applied twice
    per_step = 2 * block + adapter  # two core blocks
    attn = 4 * d * t  # QKᵀ + AV forward per layer per token
    # r=3, k=2: one forward-only core iteration, two differentiated ones.
    expected = (
        6 * (block + block + final_norms + d * vocab)  # prelude, coda, norms, tied head
        + 6 * 2 * per_step
        + 2 * 1 * per_step
        + 3 * attn * (1 + 1 + 2 * 2)  # prelude, coda, 2 differentiated iterations × 2 blocks
        + attn * 2 * 1  # one forward-only iteration × 2 blocks
    )
    assert expected == 3_792_640
    result = flops_per_token(TINY, num_steps=3, backprop_depth=2, seq_len=t)
    assert result.useful == expected
    assert result.recompute == 0
    assert result.inference == 2 * (2 * block + final_norms + d * vocab + 3 * per_step) + attn * 8


def test_recompute_is_separate_from_useful() -> None:
    plain = flops_per_token(TINY, num_steps=6, backprop_depth=2, seq_len=32)
    ckpt = flops_per_token(
        replace(TINY, activation_checkpointing=True), num_steps=6, backprop_depth=2, seq_len=32
    )
    assert ckpt.useful == plain.useful
    # one extra forward of the two differentiated iterations, and nothing for the others
    per_iteration_forward = plain.inference - flops_per_token(TINY, 5, 2, 32).inference
    assert ckpt.recompute == pytest.approx(2 * per_iteration_forward)
    assert ckpt.hardware == ckpt.useful + ckpt.recompute


def test_useful_grows_linearly_with_depth() -> None:
    no_grad = [flops_per_token(TINY, r, 2, 64).useful for r in range(2, 10)]
    steps = {b - a for a, b in itertools.pairwise(no_grad)}
    assert len(steps) == 1  # each extra forward-only iteration adds the same amount
    with_grad = [flops_per_token(TINY, r, 100, 64).useful for r in range(2, 10)]
    grad_steps = {b - a for a, b in itertools.pairwise(with_grad)}
    assert len(grad_steps) == 1
    assert grad_steps.pop() == pytest.approx(3 * steps.pop())  # fwd+bwd = 3 × fwd


def _count_with_torch(cfg, num_steps: int, backprop_depth: int, seq_len: int) -> float:
    """FLOPs per token of one forward+backward as counted by torch.utils.flop_counter."""

    def cpu_sdpa(q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q, k, v)

    def cpu_sdpa_backward(grad_out, q, k, v, *args, out_shape=None, **kwargs):
        # torch's formula includes the flash kernel recomputing QKᵀ (5 matmuls); PaLM's convention
        # counts the backward's 4 (grads of scores, V, Q, K), like our model FLOPs.
        assert sdpa_backward_flop_count(grad_out, q, k, v) == 5 * sdpa_flop_count(q, k, v) // 2
        return 2 * sdpa_flop_count(q, k, v)

    # torch's counter knows the CUDA attention kernels but not the CPU one
    mapping = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_sdpa_backward,
    }
    torch.manual_seed(0)
    model = RecurrentLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, seq_len))
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        loss = model(ids, labels=ids, num_steps=num_steps, backprop_depth=backprop_depth).loss
        loss.backward()
    return counter.get_total_flops() / ids.numel()


@pytest.mark.parametrize(
    ("num_steps", "backprop_depth", "checkpointing"),
    [(3, 2, False), (3, 8, False), (4, 2, True), (2, 0, False)],
)
def test_matches_torch_flop_counter(
    num_steps: int, backprop_depth: int, checkpointing: bool
) -> None:
    cfg = replace(TINY, activation_checkpointing=checkpointing)
    ours = flops_per_token(cfg, num_steps, backprop_depth, seq_len=16)
    counted = _count_with_torch(cfg, num_steps, backprop_depth, seq_len=16)
    # torch counts matmuls only; we also count RMSNorm gains and qk biases as parameters (PaLM's
    # 6·N), which are 0.45 % of this tiny model's executed parameters.
    assert ours.hardware == pytest.approx(counted, rel=0.006)
    assert ours.hardware > counted


def test_gemm_probe_measures_something_plausible() -> None:
    achieved = measure_gemm_flops(torch.float32, size=128, seconds=0.05)
    assert 1e8 < achieved < 1e14


def test_peak_flops_on_cpu_is_measured_once() -> None:
    first, source = peak_flops(torch.device("cpu"), torch.float32)
    again, _ = peak_flops(torch.device("cpu"), torch.float32)
    assert "measured" in source
    assert first == again > 0


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("AMD Instinct MI250X / MI250", 191.5e12),
        ("AMD Instinct MI300X", 1307e12),
    ],
)
def test_peak_flops_table_matches_device_names(monkeypatch, name: str, expected: float) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    value, source = peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert value == expected
    assert "datasheet" in source
    known = {key for v in vendors.VENDORS.values() for key in v.PEAK_BF16_FLOPS}
    assert known >= {"MI250X", "MI300X", "A100", "H100", "H200"}
    assert vendors.peak_bf16_flops("NVIDIA H100 PCIe") == (756e12, "H100 PCIe")
    assert vendors.peak_bf16_flops("AMD Instinct MI300X") == (1307e12, "MI300X")


def test_unknown_gpu_falls_back_to_measuring(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    monkeypatch.setattr(flops, "_measured_peak", lambda device, dtype: 123.0)
    assert peak_flops(torch.device("cuda", 0), torch.bfloat16)[0] == 123.0


def test_fp16_peak_on_cpu_is_not_below_what_a_linear_layer_achieves() -> None:
    """MFU on CPU in fp16 read ~400 %: the probe timed torch.mm, which has no fast fp16 CPU path,
    while the model's nn.Linear layers run a kernel 20x faster."""
    layer = torch.nn.Linear(1024, 1024, bias=False).half()
    x = torch.randn(1024, 1024).half()
    with torch.no_grad():
        layer(x)
        best = min(_timed(lambda: layer(x)) for _ in range(3))
    achieved = 2 * 1024**3 / best
    probe = measure_gemm_flops(torch.float16, seconds=0.2)
    assert probe >= 0.5 * achieved, (probe, achieved)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_autocast_peak_on_cpu_is_not_below_fp32(dtype: torch.dtype) -> None:
    """fp16 MFU on CPU still read ~400 %: under autocast a step runs fp32 matmuls too (the loss
    head over the fp32 stream, anything autocast leaves in fp32), and on a CPU without fast
    fp16 kernels those run 10-60x faster than the fp16 probe (measured here: F.linear 1024^3
    fp16 1.1-4.7 GFLOP/s, fp32 80). The peak of a mixed step is the fastest of its dtypes."""
    cpu = torch.device("cpu")
    peak, source = peak_flops(cpu, dtype)
    # The very probes peak_flops took (measured once per process): a fresh fp32 probe compared
    # with a peak measured earlier in the session fails whenever the machine's load changed.
    probes = {d: flops._measured_peak(cpu, d) for d in (dtype, torch.float32)}
    assert peak == max(probes.values()), (peak, probes, source)
    assert "float32" in source and str(dtype).removeprefix("torch.") in source, source


def _timed(fn) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        fn()
    return time.perf_counter() - start
