"""Every registered attention scripts with torch.jit.script (as timm's Attention does) and gives
the eager module's outputs; routed attention compiles as one graph in training. MoH's eval-time
sparse path is eager under both (see MoHAttention.forward)."""

import pytest
import torch

import visattn

VARIANT_KWARGS = {
    "uneven": {"head_dims": [4, 4, 8, 8, 8, 8, 12, 12]},
    "cosine": {"position_bias": False},
}


def _build(name, routed, **extra):
    kwargs = {**VARIANT_KWARGS.get(name, {}), **extra}
    if routed and name != "moh":
        kwargs.update(shared_heads=2, routed_topk=3)
    return visattn.build_attention(name, 64, num_heads=8, **kwargs)


@pytest.mark.parametrize("routed", [False, True], ids=["plain", "routed"])
@pytest.mark.parametrize("name", visattn.list_attentions())
def test_every_attention_scripts_and_matches_eager(name, routed):
    torch.manual_seed(0)
    attn = _build(name, routed)
    scripted = torch.jit.script(attn)
    x = torch.randn(2, 17, 64)
    for train in (False, True):
        attn.train(train), scripted.train(train)
        torch.testing.assert_close(scripted(x), attn(x), rtol=1e-4, atol=1e-5)
    if attn.router is not None:  # the training forward stored its load-balancing loss
        torch.testing.assert_close(scripted.router.aux_loss, attn.router.aux_loss)


def test_cosine_with_its_position_bias_scripts():
    attn = visattn.build_attention("cosine", 64, num_heads=8, grid_size=(4, 4))
    x = torch.randn(2, 17, 64)
    torch.testing.assert_close(torch.jit.script(attn)(x), attn(x), rtol=1e-4, atol=1e-5)


def test_scripted_moh_takes_the_dense_path_in_eval():
    torch.manual_seed(0)
    attn = visattn.build_attention("moh", 64, num_heads=8, shared_heads=2, routed_topk=2).eval()
    assert attn.uses_sparse()
    x = torch.randn(2, 17, 64)
    torch.testing.assert_close(torch.jit.script(attn)(x), attn(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name, kwargs", [("moh", {}), ("cosine", {"grid_size": (4, 4)})])
def test_routed_attention_compiles_as_one_graph_in_training(name, kwargs):
    """fullgraph=True fails on any graph break; aot_eager checks the capture without the slow
    inductor C++ build on CPU."""
    torch.manual_seed(0)
    attn = visattn.build_attention(name, 32, num_heads=4, shared_heads=1, routed_topk=2, **kwargs).train()
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 17, 32, requires_grad=True)
    out = compiled(x)
    torch.testing.assert_close(out, attn(x), rtol=1e-4, atol=1e-5)
    (out.sum() + attn.router.aux_loss).backward()
    assert attn.router.routed.weight.grad is not None
