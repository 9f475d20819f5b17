"""Compile-only check of csrc/ without a GPU: nvcc for sm_80 + sm_90, g++ for the torch binding.

The two compilers run in parallel (one nvcc invocation covers both architectures). The CPU torch
wheel ships the ATen/c10 CUDA headers but not the generated c10/cuda/impl/cuda_cmake_macros.h, so a
stub of that one file is written to a temporary include directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "csrc"

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")


def _cuda_include() -> Path:
    """The toolkit's include dir (nvcc may be a wrapper script outside the toolkit)."""
    roots = [os.environ.get("CUDA_HOME", ""), str(Path(NVCC).resolve().parents[1]), "/usr/local/cuda"]
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda_runtime.h").is_file():
            return Path(root) / "include"
    pytest.skip("CUDA toolkit headers (cuda_runtime.h) not found; set CUDA_HOME")


def test_kernels_and_binding_compile(tmp_path):
    torch = pytest.importorskip("torch")
    torch_dir = Path(torch.__file__).parent
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")

    nvcc_cmd = [
        NVCC, "-c", str(CSRC / "similarity_kernels.cu"), "-o", str(tmp_path / "kernels.o"),
        "-std=c++17", "-O3", "--use_fast_math", "-Werror", "all-warnings",
        "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
    ]
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    cxx_cmd = [
        cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Werror", "-DTORCH_EXTENSION_NAME=_C",
        f"-I{tmp_path / 'stub'}", f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-I{_cuda_include()}", f"-I{sysconfig.get_paths()['include']}",
        str(CSRC / "similarity_ops.cpp"),
    ]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in (nvcc_cmd, cxx_cmd)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert procs[0].returncode == 0, f"nvcc failed:\n{outputs[0][-4000:]}"
    assert procs[1].returncode == 0, f"binding failed to compile:\n{outputs[1][-4000:]}"
    assert (tmp_path / "kernels.o").stat().st_size > 0
