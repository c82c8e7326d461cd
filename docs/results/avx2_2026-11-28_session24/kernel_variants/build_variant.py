"""Build a variant of visattn/kernels/small_attention.cpp as its own op namespace (torch.ops.visx<tag>), for x86-64-v3
alone (the target_clones dropped: one clone compiles in about 2.5 minutes on 2 cores, the project's build of every
kernel in 5-6), beside the project's build, so both run in one process.

    from build_variant import build
    ops = build("variant.cpp", "1")   # a copy of small_attention.cpp, e.g. with a .diff of this folder applied
"""

import pathlib
import re
import tempfile

import torch
from torch.utils import cpp_extension

KERNELS = pathlib.Path(__file__).resolve().parents[4] / "visattn" / "kernels"


def build(cpp: str, tag: str):
    source = pathlib.Path(cpp).read_text()
    source = source.replace("TORCH_LIBRARY_FRAGMENT(visattn,", f"TORCH_LIBRARY(visx{tag},")
    source = source.replace("TORCH_LIBRARY_IMPL(visattn,", f"TORCH_LIBRARY_IMPL(visx{tag},")
    simd = (KERNELS / "simd.h").read_text()
    clones = r"#define (VISATTN_SIMD_CLONES(_V3)?) __attribute__\(\(target_clones\([^)]*\)\)\)"
    simd = re.sub(clones, r"#define \1", simd)
    folder = pathlib.Path(tempfile.mkdtemp(prefix=f"visx{tag}_"))
    (folder / "simd.h").write_text(simd)
    (folder / "kernel.cpp").write_text(source)
    cpp_extension.load(name=f"visx{tag}", sources=[str(folder / "kernel.cpp")],
                       extra_cflags=["-O3", "-fno-trapping-math", "-fopenmp", "-march=x86-64-v3", "-std=c++20"],
                       extra_ldflags=["-fopenmp"], is_python_module=False, build_directory=str(folder))
    return getattr(torch.ops, f"visx{tag}")
