"""``python -m visattn.kernels``: build the compiled kernels now (and say whether they load)."""

import logging
import sys

import torch

from visattn.kernels import kernel_dir, moh_routed_heads_op, moh_routing_op

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
if moh_routing_op() is None:
    logging.getLogger("visattn.kernels").warning("not built: MoH will run its PyTorch code")
    sys.exit(0)  # the fallback works; an install does not fail for want of a compiler
gemms = [str(dtype).removeprefix("torch.") for dtype in (torch.float32, torch.bfloat16) if moh_routed_heads_op(dtype)]
logging.getLogger("visattn.kernels").info(
    "MoH kernels built and loaded (%s); routed heads kernel for: %s", kernel_dir(), ", ".join(gemms) or "no dtype (no MKL GEMM)"
)
