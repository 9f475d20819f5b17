"""Builds the optional extensions: the CPU sample-index packer `pretrain.data._index` (csrc/cpu/) and the CUDA
extension `pretrain._C` (csrc/); metadata lives in pyproject.toml.

The CUDA extension is built only when torch can be imported here, is a CUDA build, and nvcc is found
(`pip install --no-build-isolation .` on a GPU machine); otherwise the package installs without it and
pretrain.ops uses its chunked torch path. PRETRAIN_BUILD_CUDA=0 skips the build, =1 makes a failed
detection an error. Architectures default to TORCH_CUDA_ARCH_LIST="8.0;9.0" (the kernels need sm_80+).
"""

from __future__ import annotations

import os
import shutil

from setuptools import Extension, setup

NVCC_FLAGS = ["-O3", "--use_fast_math", "-lineinfo"]  # keep in sync with pretrain/ops/extension.py
SOURCES = ["csrc/similarity_ops.cpp", "csrc/similarity_kernels.cu"]


def _cuda_extension_kwargs() -> dict:
    wanted = os.environ.get("PRETRAIN_BUILD_CUDA", "auto").lower()
    if wanted in ("0", "false", "no"):
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        reason = "torch is not importable at build time (use --no-build-isolation)"
    else:
        if torch.version.cuda is None:
            reason = "torch is a CPU-only build"
        elif cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
            reason = "nvcc / CUDA_HOME not found"
        else:
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
            ext = cpp_extension.CUDAExtension(
                name="pretrain._C",
                sources=SOURCES,
                extra_compile_args={"cxx": ["-O3"], "nvcc": NVCC_FLAGS},
            )
            return {"ext_modules": [ext], "cmdclass": {"build_ext": cpp_extension.BuildExtension}}
    if wanted in ("1", "true", "yes"):
        raise RuntimeError(f"PRETRAIN_BUILD_CUDA=1 but the CUDA extension cannot be built: {reason}")
    print(f"pretrain: building without the CUDA extension ({reason})")
    return {}


# The sample-index packer (pure C, no torch): built everywhere a C compiler is found; without it the data
# path falls back to the same rule in Python (optional=True: a failed build never fails the install).
CPU_EXTENSIONS = [Extension("pretrain.data._index", ["csrc/cpu/sample_index.c"], optional=True,
                            extra_compile_args=["-O3"]),
                  Extension("pretrain.model._kernels", ["csrc/cpu/model_kernels.c"], optional=True,
                            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"],
                            extra_link_args=["-fopenmp"], libraries=["m"])]

kwargs = _cuda_extension_kwargs()
kwargs["ext_modules"] = CPU_EXTENSIONS + kwargs.get("ext_modules", [])
setup(**kwargs)
