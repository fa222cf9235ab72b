"""CompiledAdamW (train.adamw_impl=compiled) on a CUDA device, compiled as the loop runs it there,
against torch's fused CUDA AdamW. Skipped without a CUDA device (CI has none); needs torch only."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu


def test_compiled_adamw_on_cuda_takes_fused_adamws_steps():
    """12 steps, a rate and a clip coefficient that change every step, two groups: the same
    parameters and moments as fused AdamW, float32 step counters on the device, and no graph beyond
    the four first ones (two groups, with and without grad_scale)."""
    import torch._dynamo
    from conftest import compiled_adamw_against_fused
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # what earlier tests compiled in this process
    mine, ref, opt, ref_opt = compiled_adamw_against_fused(True, device="cuda")
    for a, b in zip(mine, ref):
        assert a.is_cuda and (a - b).abs().max() <= 1e-6 * b.abs().max(), float((a - b).abs().max())
        sa, sb = opt.state[a], ref_opt.state[b]
        assert sa["step"].is_cuda and sa["step"].dtype == torch.float32 and float(sa["step"]) == 12.0
        for k in ("exp_avg", "exp_avg_sq"):  # lerp against fused's beta1 m + (1 - beta1) g: float32 rounding apart
            assert (sa[k] - sb[k]).abs().max() <= 1e-6 * sb[k].abs().max(), (k, float((sa[k] - sb[k]).abs().max()))
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])
