"""Mixture-of-Head attention (MoH, arXiv 2410.11842): routing on ``HeadAttention`` with MoH's default
budget, and its exact inference paths.

Paths (all equal to the masked dense one up to float rounding):

- ``masked_dense``: every head computed, unselected ones zeroed by their gates (the reference, the
  training path, and what the released MoH code runs; where small heads run the kernels' attention, it skips
  the (token, head) rows gated 0 and gates the others as it writes them, with the same output and, for soft
  gates, the same gradients: ``HeadAttention.gated_sdpa``);
- ``dense_projections``: one qkv and one output matmul, attention only for the selected pairs
  (``visattn.attention.sparse``);
- ``sparse_projections``: queries, attention and output projection only for the selected pairs
  (token choice with the linear router; ``visattn.attention.sparse``);
- ``routed_kernel`` / ``routed_kernel_loops``: the same, with the heads per image in one compiled pass
  (MKL's GEMMs for the routed heads / whole-tensor projections and the kernel's own attention loops for
  every head, float32; ``visattn.attention.routed_kernel``; token or head choice; ``sparse_projections``,
  for head choice ``head_gather``, where the kernel cannot run);
- ``masked_kernel_loops``: the masked dense computation in that kernel (the attention of every pair,
  unselected ones zeroed by their gates; float32); ``masked_dense`` where the kernel cannot run;
- ``routed_kernel_dense``: ``dense_projections`` with the selected pairs' attention in the kernel
  (float32; bfloat16 on AMX tiles); ``dense_projections`` where it cannot run;
- ``routed_kernel_grouped``: ``routed_kernel_dense`` with the output projection of the selected pairs
  alone (bfloat16 on AMX tiles; the tokens grouped by the routed heads they chose); elsewhere it is
  ``routed_kernel_dense``;
- ``head_gather`` / ``head_gather_dense_out``: head choice's static-shape path, gathered queries in
  batched matmuls (``visattn.attention.head_gather``).

``impl="auto"`` times the paths a layer has on the running machine and keeps the fastest
(``visattn.attention.impl_probe``); ``visattn.attention.impl_choices(model)`` reports what each
layer chose.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from visattn.kernels import build_id, moh_routing_op

from .base import HeadAttention
from .fused_gating import functorch_active, needs_grad
from .head_gather import head_gather_forward, head_gather_supported
from .impl_probe import PathChoice, device_name, impl_probe
from .registry import register_attention
from .routed_kernel import (
    DENSE_KERNEL_PATH,
    GROUPED_KERNEL_PATH,
    KERNEL_PATHS,
    MASKED_KERNEL_PATH,
    kernel_path_runs,
    kernel_runs,
    preferred_kernel_path,
    routed_dense_forward,
    routed_kernel_forward,
    routed_kernel_supported,
)
from .routing import default_budget
from .sparse import (
    SPARSE_PROJECTION_MAX_DENSITY,
    compute_dtype,
    routed_density,
    sparse_moh_forward,
    sparse_moh_supported,
)

PATHS: dict[str, Callable[[HeadAttention, torch.Tensor], torch.Tensor]] = {
    "masked_dense": lambda attn, x: attn.dense_forward(x),
    "dense_projections": lambda attn, x: sparse_moh_forward(attn, x, projections="dense"),
    "sparse_projections": lambda attn, x: sparse_moh_forward(attn, x, projections="sparse"),
    "routed_kernel": lambda attn, x: routed_kernel_forward(attn, x, loops=False),
    "routed_kernel_loops": lambda attn, x: routed_kernel_forward(attn, x, loops=True),
    MASKED_KERNEL_PATH: lambda attn, x: routed_kernel_forward(attn, x, loops=True, every_head=True),
    DENSE_KERNEL_PATH: routed_dense_forward,
    GROUPED_KERNEL_PATH: lambda attn, x: routed_dense_forward(attn, x, grouped=True),
    "head_gather": lambda attn, x: head_gather_forward(attn, x, output="rows"),
    "head_gather_dense_out": lambda attn, x: head_gather_forward(attn, x, output="dense"),
}
REFERENCE_PATH = "masked_dense"
# "dense" is the masked dense path; "sparse" the skipping path the layer's routing is built for.
MOH_IMPLS = ("auto", "dense", "sparse", *PATHS)
# What impl="auto" may train on: the reference, and the one skipping path with a compiled backward (the
# PyTorch ones train slower than the masked dense path: MoH-75 on dense_projections trained the study's
# ViT at 0.82x MHA's speed, against 0.93x; docs/benchmarks.md).
TRAIN_PATHS = (REFERENCE_PATH, "routed_kernel_loops")


def available_paths(attn: HeadAttention) -> list[str]:
    """The exact paths ``attn`` can run without a mask, reference first (for a dense layer,
    ``routed_topk=0``: every head on, the reference and the loops kernel, which skips nothing)."""
    paths = [REFERENCE_PATH]
    router = attn.router
    if sparse_moh_supported(attn) is not None:
        return paths
    if router.routed_topk == 0:  # routed_kernel_loops is masked_kernel_loops' computation here
        return paths + (["routed_kernel_loops"] if routed_kernel_supported(attn) is None else [])
    paths.append("dense_projections")
    if router.routing == "token_choice" and router.router_kind == "linear":
        paths.append("sparse_projections")
    if routed_kernel_supported(attn) is None:
        paths += KERNEL_PATHS
    if head_gather_supported(attn) is None:
        paths += ["head_gather", "head_gather_dense_out"]
    return paths


def _fixed_path(attn: HeadAttention, impl: str, paths: list[str]) -> str | None:
    """The path ``impl`` names for ``attn`` (None for ``auto``); a ValueError naming the paths the layer
    has when it cannot run it."""
    if impl == "auto":
        return None
    if impl == "dense":
        return REFERENCE_PATH
    if impl == "sparse":
        reason = sparse_moh_supported(attn)
        if reason is not None:
            raise ValueError(f"impl='sparse' is not available here: {reason}; use impl='dense' or 'auto'")
        if len(paths) == 1 or attn.router.routed_topk == 0:  # nothing to skip
            return REFERENCE_PATH
        if "head_gather" in paths:
            return "head_gather"
        few = routed_density(attn) <= SPARSE_PROJECTION_MAX_DENSITY
        if few and "routed_kernel" in paths:
            return preferred_kernel_path(attn)  # sparse_projections where the kernel cannot run
        if few and "sparse_projections" in paths:
            return "sparse_projections"
        # dense projections: compiled where the kernel runs, else the same computation in PyTorch
        return DENSE_KERNEL_PATH if DENSE_KERNEL_PATH in paths else "dense_projections"
    if impl not in paths:
        raise ValueError(
            f"impl={impl!r} is not available for this layer (routing={attn.router.routing!r}, "
            f"router={attn.router.router_kind!r}); it has: {', '.join(['auto', 'dense', *paths])}"
        )
    return impl


@register_attention("moh")
class MoHAttention(HeadAttention):
    """Mixture-of-Head attention: shared heads always on, ``routed_topk`` of the rest per token.

    Without a budget it uses half the heads as shared and routes half of the remaining pool.
    ``routing="head_choice"`` makes each routed head take a fixed share of each image's tokens
    instead (see ``visattn.attention.routing``; registered as ``moh_head_choice`` too).

    ``impl``: ``"auto"`` (default) times the layer's exact paths on this machine in eval mode and
    keeps the fastest per input shape and dtype; ``"dense"`` is the masked dense path (the reference);
    ``"sparse"`` skips unselected heads (token choice: projections sparse up to half the routed pool,
    through the compiled kernel where it runs, dense above; head choice: ``head_gather``);
    or name a path of ``PATHS``. Under ``auto`` training takes ``train_path``: the masked dense path
    unless a run with ``train.attn_paths=probe`` set ``routed_kernel_loops`` at its start
    (``visattn.attention.train_paths``), which then runs wherever the kernel can (else the masked dense
    path). Training does not probe per forward as eval does: a choice that differed between two
    processes of one run would change its last bits, so a run makes it once and keeps it in its
    checkpoints. A named path runs in training too (every path is differentiable;
    ``routed_kernel_loops``, which ``"sparse"`` takes for small heads, trains on the compiled kernel and
    its backward), except with straight-through gates (``gate="binary_ste"``), whose gradient reaches every
    head's output, selected or not: they train on the masked dense path, every head attended. An attention
    mask, ``is_causal``, TorchScript and torch.fx always take the masked dense path.
    """

    __jit_unused_properties__ = [*HeadAttention.__jit_unused_properties__, "impl", "train_path"]

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        shared_heads: int | None = None,
        routed_topk: int | None = None,
        impl: str = "auto",
        **kwargs,
    ) -> None:
        if impl not in MOH_IMPLS:  # before building anything
            raise ValueError(f"impl={impl!r} is not known; use one of {MOH_IMPLS}")
        if routed_topk is None:
            shared_heads, routed_topk = default_budget(num_heads, shared_heads)
        super().__init__(dim, num_heads, shared_heads=shared_heads or 0, routed_topk=routed_topk, **kwargs)
        self.paths = available_paths(self)
        self.impl = impl  # sets fixed_path
        self._train_path = REFERENCE_PATH  # what training takes under auto (see train_path)
        self._trains_sparse = False  # train_path != masked_dense (a bool: TorchScript compiles uses_sparse)
        # Per instance: the path taken per (shape, dtype), for visattn.attention.impl_choices.
        self.path_log: dict[str, PathChoice] = {}
        self.last_path: str | None = None
        self._recall: tuple | None = None  # (what the last choice depended on, its probe, the choice)

    @property
    def impl(self) -> str:
        """The path setting (see the class docstring); assigning it re-checks it against the layer."""
        return self._impl

    @impl.setter
    def impl(self, impl: str) -> None:
        if impl not in MOH_IMPLS:
            raise ValueError(f"impl={impl!r} is not known; use one of {MOH_IMPLS}")
        self.fixed_path = _fixed_path(self, impl, self.paths)
        self._impl = impl

    @property
    def train_path(self) -> str:
        """The path training takes under ``impl="auto"``: ``masked_dense`` (the default) or
        ``routed_kernel_loops`` (where the layer has it), set by a run's probe
        (``visattn.attention.train_paths``); assigning checks it."""
        return self._train_path

    @train_path.setter
    def train_path(self, path: str) -> None:
        skips = self.zero_gates_carry_no_grad  # straight-through gates train on the masked dense path alone
        allowed = [p for p in TRAIN_PATHS if p in self.paths and (p == REFERENCE_PATH or skips)]
        if path not in allowed:
            raise ValueError(f"train_path={path!r} is not a training path of this layer; it has: {', '.join(allowed)}")
        self._train_path = path
        self._trains_sparse = path != REFERENCE_PATH

    def uses_sparse(self, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> bool:
        """Whether forward may leave the masked dense path for these arguments in the current mode
        (under ``auto``: in eval, when there is another path to probe; in training, per ``train_path``)."""
        if attn_mask is not None or is_causal:
            return False
        if self.training and torch.is_grad_enabled() and not self.zero_gates_carry_no_grad:
            return False  # straight-through gates: every head's output has a gradient, so no head may be skipped
        if self.fixed_path is not None:
            return self.fixed_path != REFERENCE_PATH
        if self.training:
            return self._trains_sparse
        return len(self.paths) > 1

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """x: [B, N, C] -> [B, N, dim_out]; see ``HeadAttention.forward``.

        TorchScript always takes the dense path (the other paths use Python-side choices). Under
        ``torch.compile`` the path choice and the skipping paths stay eager (data-dependent shapes
        would break the graph anyway); training, ``impl="dense"`` and a scripted module compile as one
        graph.
        """
        if not torch.jit.is_scripting() and self.uses_sparse(attn_mask, is_causal):
            return self.sparse_forward(x)
        return self.dense_forward(x, attn_mask, is_causal)

    @torch.jit.unused
    @torch.compiler.disable
    def sparse_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, N, C] through the path ``impl`` names or ``auto`` chooses. torch.fx records the dense
        path (a traced graph cannot hold data-dependent token groups); so do an empty input, meta tensors and
        tensor subclasses (fake tensors): nothing to time, no values to route by."""
        if isinstance(x, torch.fx.Proxy) or x.numel() == 0 or type(x) is not torch.Tensor or x.is_meta:
            return self.dense_forward(x)
        if self.training and self.fixed_path is None:
            # auto's training path runs the kernel where it can; elsewhere (bf16, another device, no
            # toolchain, a Python dispatch mode such as the FLOP counter) the masked dense path, not the
            # PyTorch fallback, which trains slower (and which a FLOP count would then take as the model's)
            runs = kernel_runs(self, x, loops=True) and _get_current_dispatch_mode() is None
            path = self._train_path if runs else REFERENCE_PATH
        else:
            path = self.choose_path(x).path
        if path != self.last_path:  # nn.Module's __setattr__ is slow, and a GPU layer is bound by its host's calls
            self.last_path = path
        return PATHS[path](self, x)

    @torch.jit.unused
    def choose_path(self, x: torch.Tensor) -> PathChoice:
        """The path for x: [B, N, C] in the current autocast state: ``impl``'s, or ``auto``'s probe.
        The last answer is kept on the layer, so a forward like the one before costs a tuple compare."""
        dtype = compute_dtype(x)
        probe = impl_probe()
        # what the choice and the kernel paths' availability depend on (kernel_path_runs: the mode, gradients,
        # functorch, the kernels switched on); checked first, as the availability took ~50 us a layer to work out.
        # Cheap reads only (x.is_cpu, not x.device.type): on a GPU a layer is bound by the host's calls, where this
        # check is all auto costs over the masked dense path (docs/results/gpu.md, 20th session)
        recall = (x.shape, dtype, x.device, torch.get_num_threads(), self.fixed_path, self.training,
                  needs_grad(self, x), functorch_active(), x.is_cpu and moh_routing_op() is not None)
        # the probe itself, not its id(): a probe freed and replaced may get the same id
        if self._recall is not None and self._recall[0] == recall and self._recall[1] is probe:
            return self._recall[2]
        # the kernel paths that run here (the others would time sparse_projections again)
        kernels = tuple(p for p in KERNEL_PATHS if p in self.paths and kernel_path_runs(self, x, p))
        dtype_name = str(dtype).removeprefix("torch.")
        device = device_name(x.device)
        shape = tuple(x.shape)
        if self.fixed_path is not None:
            choice = PathChoice(self.fixed_path, device, "fixed", shape, dtype_name)
        else:
            paths = [path for path in self.paths if path not in KERNEL_PATHS or path in kernels]
            runs = {path: (lambda path=path: PATHS[path](self, x)) for path in paths}
            key = (*self.probe_key(x, device, dtype_name), kernels, kernels and build_id())
            choice = probe.choose(key, runs, REFERENCE_PATH, shape, dtype_name, device)
        self._recall = (recall, probe, choice)
        self.path_log[f"{list(shape)} {dtype_name}"] = choice
        return choice

    @torch.jit.unused
    def probe_key(self, x: torch.Tensor, device: str, dtype: str) -> tuple:
        """What the fastest path depends on: machine, threads, torch, dtype, shape and the layer's
        geometry and routing (see ``visattn.attention.impl_probe``)."""
        router = self.router
        layer = (
            self.num_heads, self.num_kv_heads, self.head_dim, self.proj.out_features, router.shared_heads,
            router.routed_topk, router.routing, router.router_kind, tuple(self.paths),
        )  # fmt: skip
        return (device, torch.get_num_threads(), torch.__version__, dtype, tuple(x.shape), layer)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, impl={self.impl}"


@register_attention("moh_head_choice")
class MoHHeadChoiceAttention(MoHAttention):
    """MoH with ``routing="head_choice"`` by default: every routed head takes the
    ``round(N * routed_topk / pool)`` highest-scoring tokens of each image (static shapes, balanced
    by construction, no load-balancing loss); shared heads as in MoH. ``attn=moh_head_choice``."""

    def __init__(self, dim: int, num_heads: int = 8, *, routing: str = "head_choice", **kwargs) -> None:
        super().__init__(dim, num_heads, routing=routing, **kwargs)
