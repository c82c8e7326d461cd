"""Active-head FLOPs: the dense forward minus the inactive heads' query-side work, in closed form."""

import pytest
import torch

import visattn
from visattn.bench.active_flops import active_head_flops, query_side_flops
from visattn.utils.flops import count_flops


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
