"""``python -m visattn.kernels``: build the compiled kernels now (and say whether they load)."""

import logging
import sys

from visattn.kernels import kernel_dir, moh_routing_op

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
if moh_routing_op() is None:
    logging.getLogger("visattn.kernels").warning("not built: MoH routing will run in PyTorch")
    sys.exit(0)  # the fallback works; an install does not fail for want of a compiler
logging.getLogger("visattn.kernels").info("MoH routing kernel built and loaded (%s)", kernel_dir())
