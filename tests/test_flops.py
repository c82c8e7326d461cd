"""count_flops counts the CPU SDPA kernel (torch's counter alone reports 0 for it)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from visattn import build_attention
from visattn.utils.flops import count_flops, sdpa_flop_formulas


def test_sdpa_forward_matches_closed_form():
    B, H, N, M, d = 2, 3, 5, 7, 8
    q, k, v = torch.randn(B, H, N, d), torch.randn(B, H, M, d), torch.randn(B, H, M, d)
    assert count_flops(F.scaled_dot_product_attention, q, k, v) == 4 * B * H * N * M * d


def test_grouped_key_value_heads_count_as_the_query_heads_they_serve():
    """enable_gqa shares each key/value head among query heads; scores are computed per query head.
    The formulas take the grouped shapes themselves (torch 2.11's own formula rejects them)."""
    B, H, G, N, M, d = 2, 8, 2, 5, 7, 4
    q, k, v = torch.randn(B, H, N, d), torch.randn(B, G, M, d), torch.randn(B, G, M, d)
    assert count_flops(F.scaled_dot_product_attention, q, k, v, enable_gqa=True) == 4 * B * H * N * M * d
    forward = sdpa_flop_formulas()[torch.ops.aten._scaled_dot_product_flash_attention]
    assert forward((B, H, N, d), (B, G, M, d), (B, G, M, d)) == 4 * B * H * N * M * d
    backward = sdpa_flop_formulas()[torch.ops.aten._scaled_dot_product_efficient_attention_backward]
    grouped = backward((B, H, N, d), (B, H, N, d), (B, G, M, d), (B, G, M, d))
    assert grouped == backward((B, H, N, d), (B, H, N, d), (B, H, M, d), (B, H, M, d)) > 0


def test_sdpa_counted_under_bf16_autocast_and_backward():
    B, H, N, d = 1, 2, 6, 4
    q = torch.randn(B, H, N, d, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert count_flops(F.scaled_dot_product_attention, q, q, q) == 4 * B * H * N * N * d

    def step(q):
        F.scaled_dot_product_attention(q, q, q).sum().backward()

    # backward recomputes the scores and does four more matmuls: 7 matmuls of 2*B*H*N*N*d in all
    assert count_flops(step, q) == 7 * 2 * B * H * N * N * d


def test_attention_module_counts_projections_and_core():
    B, N, C, H = 2, 9, 16, 4
    attn = build_attention("mha", C, num_heads=H).eval()
    x = torch.randn(B, N, C)
    projections = 2 * B * N * C * 3 * C + 2 * B * N * C * C
    assert count_flops(attn, x) == projections + 4 * B * N * N * C


def test_module_is_counted_without_grad():
    lin = nn.Linear(4, 3)
    assert count_flops(lin, torch.randn(5, 4)) == 2 * 5 * 4 * 3
    assert lin.weight.grad is None
