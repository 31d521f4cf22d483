"""Go-live thresholds per GPU SKU (stdlib only): what `rlmctl accept` asks of a run by default.

The seed's figure is 120 TFLOP/s per GPU on MI250X-class hardware (a GCD: 63 % of its 191.5
TFLOP/s bf16 peak). For the SKUs the seed does not name, the default is DEFAULT_MFU of the
datasheet peak in the vendor description (PEAK_BF16_FLOPS). Sites set their own with
rlm_accept_thresholds.tflops_per_gpu.
"""

from __future__ import annotations

TFLOPS_PER_GPU = {"MI250X": 120.0}
DEFAULT_MFU = 0.40
