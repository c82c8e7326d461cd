"""Active-head FLOPs: the dense forward minus the inactive heads' query-side work, in closed form."""

import pytest
import torch

import visattn
from visattn.utils.flops import active_head_flops, count_flops, query_side_flops


def test_all_heads_active_equals_the_dense_count():
    attn = visattn.build_attention("mha", dim=16, num_heads=4).eval()
    x = torch.randn(2, 5, 16)
    assert active_head_flops(attn, x) == count_flops(attn.train(), x)


def test_half_the_heads_remove_half_the_query_side_work():
    torch.manual_seed(0)
    dense = visattn.build_attention("moh", dim=16, num_heads=4, shared_heads=0, routed_topk=4, two_stage=False)
    half = visattn.build_attention("moh", dim=16, num_heads=4, shared_heads=1, routed_topk=1)
    x = torch.randn(2, 5, 16)
    assert half.active_heads == (2, 4)
    expected = count_flops(half.train(), x) - 0.5 * query_side_flops(2, 5, 16, 16)
    assert active_head_flops(half.eval(), x) == pytest.approx(expected)
    assert not half.training  # the mode is restored
    assert active_head_flops(dense, x) == count_flops(dense.train(), x)
    # 4 B N C D + 4 B N^2 D with B=2, N=5, C=D=16
    assert query_side_flops(2, 5, 16, 16) == 4 * 2 * 5 * 16 * 16 + 4 * 2 * 25 * 16


def test_counting_leaves_batch_norm_statistics_untouched():
    """The dense count runs a training-mode forward; it must not move running statistics."""
    torch.manual_seed(0)
    half = visattn.build_attention("moh", dim=16, num_heads=4, shared_heads=1, routed_topk=1)
    model = torch.nn.Sequential(half, torch.nn.BatchNorm1d(5)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flops = active_head_flops(model, torch.randn(2, 5, 16) + 3.0)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not model.training
    assert flops < count_flops(model.train(), torch.randn(2, 5, 16))  # the 2 inactive heads are taken off
