import math

import pytest
import torch
from torch import nn

from spikeguard.measure.precision import PrecisionPolicy
from tests.dist import run_distributed


def _bf16_fsdp2(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layer = nn.Linear(8, 8, bias=False)
    model = nn.Sequential(layer)
    fully_shard(model, mp_policy=PrecisionPolicy(kind="bf16-mixed").fsdp_mp_policy())
    seen = []
    layer.register_forward_pre_hook(lambda m, a: seen.append((m.weight.dtype, a[0].dtype)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.ones(1, 8)
    contribs = [1.0] + [1e-3] * 64
    for i, g in enumerate(contribs):
        model.set_requires_gradient_sync(i == len(contribs) - 1)
        (model(x).sum() * g).backward()
    grad = layer.weight.grad
    local_grad = grad.to_local()
    opt.step()
    state = opt.state[layer.weight]
    return {
        "compute": [str(d) for d in seen[0]],
        "param_dtype": str(layer.weight.to_local().dtype),
        "grad_dtype": str(local_grad.dtype),
        "grad": local_grad.double().flatten().tolist(),
        "moment_dtypes": [str(state["exp_avg"].to_local().dtype),
                          str(state["exp_avg_sq"].to_local().dtype)],
    }


@pytest.mark.dist
def test_bf16_mixed_under_fsdp2_computes_in_bf16_and_accumulates_in_fp32():
    results = run_distributed(_bf16_fsdp2, 2)
    # the fp64 reference sums the bf16-rounded per-micro-batch grads (compute is bf16)
    bf16 = [float(torch.tensor(g, dtype=torch.bfloat16)) for g in [1.0] + [1e-3] * 64]
    ref = math.fsum(bf16)
    acc16 = torch.zeros((), dtype=torch.bfloat16)
    for g in bf16:
        acc16 += g
    for r in results:
        assert r["compute"] == ["torch.bfloat16", "torch.bfloat16"]
        assert r["param_dtype"] == r["grad_dtype"] == "torch.float32"
        assert r["moment_dtypes"] == ["torch.float32", "torch.float32"]
        assert len(r["grad"]) == 32  # 64 elements sharded over 2 ranks
        assert max(abs(g - ref) for g in r["grad"]) < 1e-6
    assert abs(float(acc16) - ref) > 0.05  # the same sum in a bf16 accumulator loses it
