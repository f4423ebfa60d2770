"""Projections fused at load time (gate|up, q|k|v, KDA's f_a|g_a|b) give, on the CPU reference
path, exactly the separate checkpoint matmuls: fp32 parity with transformers depends on it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.models.layers.common import Linear


def test_sharded_linear_is_bitwise_the_separate_matmuls():
    torch.manual_seed(0)
    sizes = [8, 8, 2]
    fused = Linear(24, sum(sizes), bias=True, shard_sizes=sizes)
    x = torch.randn(9, 24)
    parts = [
        F.linear(x, w.clone(), b.clone()) for w, b in zip(fused.weight.split(sizes), fused.bias.split(sizes))
    ]
    assert torch.equal(fused(x), torch.cat(parts, dim=-1))
    # one matmul over the stacked rows rounds differently: the reason for the split path
    plain = Linear(24, sum(sizes), bias=True)
    plain.load_state_dict(fused.state_dict())
    assert torch.allclose(plain(x), fused(x), atol=1e-5)


def test_loader_fills_each_shard_from_its_checkpoint_tensor():
    from deltaserve.models.checkpoints.weights import WeightLoader
    from deltaserve.models.layers.common import GatedMLP

    mlp = GatedMLP(6, 4)
    gate, up, down = torch.randn(4, 6), torch.randn(4, 6), torch.randn(6, 4)
    loader = WeightLoader(mlp)
    loader.copy("up_proj.weight", up)
    loader.copy("gate_proj.weight", gate)
    loader.copy("down_proj.weight", down)
    loader.finish()
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]))
    x = torch.randn(3, 6)
    assert torch.equal(mlp(x), F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down))


def test_loader_names_a_missing_shard():
    import pytest

    from deltaserve.models.checkpoints.weights import WeightLoader
    from deltaserve.models.layers.common import GatedMLP

    mlp = GatedMLP(6, 4)
    loader = WeightLoader(mlp)
    loader.copy("gate_proj.weight", torch.randn(4, 6))
    loader.copy("down_proj.weight", torch.randn(6, 4))
    with pytest.raises(ValueError, match="gate_up_proj"):
        loader.finish()


def test_attention_output_gate_on_cpu_is_bitwise_transformers_order():
    """transformers gates `[T, H * D]` rows; a sigmoid over the strided `[T, H, D]` view of the
    gate inside q_proj's output runs D-long inner loops whose tails round differently in fp32."""
    from deltaserve.kernels.norm import sigmoid_gate

    torch.manual_seed(0)
    for d in (16, 24, 40, 100, 256):
        t, h = 5, 3
        o = torch.randn(t, h, d)
        gate = torch.randn(t, h, 2 * d).chunk(2, dim=-1)[1]
        expect = o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        assert torch.equal(sigmoid_gate(o, gate).reshape(t, -1), expect), d
