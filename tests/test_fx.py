"""torch.fx tracing of every registered attention: inside a timm ViT the way timm's own
``tests/test_models.py`` traces (``test_model_forward_fx`` / ``test_model_backward_fx``: torchvision's
feature extractor with timm's leaf modules and functions), and as a single module called with masks.

timm's ``VisionTransformer.forward(x, attn_mask=None, is_causal=False)`` hands ``attn_mask`` and
``is_causal`` to the attention as symbolic values while tracing, so the graph must hold no branch on
them: it gives the eager output without a mask, and with one."""

import pytest
import timm
import torch
from timm.layers import get_notrace_functions, get_notrace_modules
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import visattn

TINY = "visattn_vit_tiny_patch2_8"
# Small settings that every variant accepts (8 heads of width 8 or 4).
VARIANT_KWARGS = {"uneven": {"head_dims": [4, 4, 8, 8, 8, 8, 12, 12]}}


def _timm_fx_model(model: torch.nn.Module) -> torch.nn.Module:
    """timm test_models.py's ``_create_fx_model``: a feature extractor returning the last node (the
    logits) in train and in eval mode, traced with timm's leaf modules and functions."""
    tracer_kwargs = dict(
        leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(), param_shapes_constant=True
    )
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)
    return create_feature_extractor(
        model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]], tracer_kwargs=tracer_kwargs
    )


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")  # MoH's aux loss
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", visattn.list_attentions())
def test_every_variant_traces_in_a_vit_as_timm_tests_do(name, train):
    """Traced logits equal eager ones, and in training so do the gradients (no dropout in this model:
    deterministic). MoH's traced graph holds its dense path, MTA's its reference path."""
    torch.manual_seed(0)
    model = timm.create_model(TINY, attn={"name": name, **VARIANT_KWARGS.get(name, {})}, depth=2).train(train)
    traced = _timm_fx_model(model).train(train)
    x = torch.randn(2, 1, 8, 8)
    (out,) = traced(x).values()
    expected = model(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    if not train:
        return
    params = dict(model.named_parameters())
    eager_grads = torch.autograd.grad(expected.square().mean(), list(params.values()))
    traced_params = dict(traced.named_parameters())
    assert traced_params.keys() <= params.keys()
    traced_grads = torch.autograd.grad(out.square().mean(), list(traced_params.values()))
    eager_by_name = dict(zip(params, eager_grads, strict=True))
    for key, grad in zip(traced_params, traced_grads, strict=True):
        torch.testing.assert_close(grad, eager_by_name[key], rtol=1e-4, atol=1e-5, msg=key)


MASK_KWARGS = {**VARIANT_KWARGS, "cosine": {"grid_size": (4, 4)}, "mta": {"causal": True}}


@pytest.mark.parametrize("name", visattn.list_attentions())
def test_a_traced_attention_takes_masks_as_eager(name):
    """One graph serves every call: no mask, a bool mask, a float mask or is_causal (nothing about
    the mask is baked in while tracing). Cosine adds its position bias; a causal MTA layer
    always masks the future."""
    torch.manual_seed(0)
    attn = visattn.build_attention(name, 64, num_heads=8, **MASK_KWARGS.get(name, {})).eval()
    traced = torch.fx.symbolic_trace(attn)
    x = torch.randn(2, 17, 64)  # class token + 4x4 grid
    keep = torch.rand(2, 1, 17, 17) > 0.3
    keep[..., 0] = True  # every query keeps a key
    float_mask = torch.randn(2, 1, 17, 17)
    for kwargs in ({}, {"attn_mask": keep}, {"attn_mask": float_mask}, {"is_causal": True}):
        torch.testing.assert_close(traced(x, **kwargs), attn(x, **kwargs), rtol=1e-4, atol=1e-5, msg=str(kwargs))


@pytest.mark.filterwarnings("ignore:The nodes obtained by tracing the model in train mode")
@pytest.mark.parametrize("name", ["relu", "adaptive", "moh"])
def test_tracing_leaves_no_symbolic_statistics_on_the_model(name):
    """Statistics recorded per forward (relu's zero fraction, adaptive's head widths, routed heads'
    load) are not recorded while fx traces, so attention_stats never returns an fx Proxy."""
    torch.manual_seed(0)
    kwargs = {"shared_heads": 2, "routed_topk": 2} if name == "moh" else {}
    model = timm.create_model(TINY, attn={"name": name, **kwargs}, depth=2).eval()
    model(torch.randn(2, 1, 8, 8))  # eager: real statistics
    _timm_fx_model(model)
    stats = [v for layer in visattn.attention_stats(model) for v in layer.values()]
    assert stats and all(isinstance(v, torch.Tensor) and not isinstance(v, torch.fx.Proxy) for v in stats)
