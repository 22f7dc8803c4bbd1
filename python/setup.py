# SPDX-License-Identifier: Apache-2.0
"""Builds writescope._C, the torch extension over the header-only library.

The host backend is always compiled. The CUDA backend (a .cu translation unit
for nvcc and the host code of writescope/cuda/cuda_backend.hpp) only when
torch has CUDA and torch.version.cuda's major version equals nvcc's; otherwise
the build says why and the extension refuses backend="cuda" with that reason.

Environment (all optional):
  WRITESCOPE_CUDA          auto (default) | 0 (never) | 1 (required: fail when it cannot be built)
  WRITESCOPE_CPU_ARCH      native (default) | avx512 | avx2 | sse2: ISA of the CPU attention kernel
  WRITESCOPE_INCLUDE_DIR   the library's include/ (default: ../include of this file)
  WRITESCOPE_EXTRA_INCLUDE more include directories (os.pathsep-separated), e.g. a staged xsimd;
                           ../.deps/usr/include is added when it exists (the GPU machine's staging)
  TORCH_CUDA_ARCH_LIST     GPU architectures (default here: 9.0, the H100/H200)
  MAX_JOBS                 parallel compile jobs (torch's ninja build)
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

import torch
from torch.utils import cpp_extension

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CPU_ARCH_FLAGS = {
    "native": ["-march=native"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma"],
    "avx2": ["-mavx2", "-mfma"],
    "sse2": [],
}


def say(msg):
    print(f"[writescope setup] {msg}", file=sys.stderr, flush=True)


def include_dirs():
    inc = Path(os.environ.get("WRITESCOPE_INCLUDE_DIR", ROOT / "include"))
    if not (inc / "writescope" / "writescope.hpp").is_file():
        sys.exit(f"[writescope setup] {inc} has no writescope/writescope.hpp: build from the repository checkout "
                 "(pip install --no-build-isolation ./python) or set WRITESCOPE_INCLUDE_DIR")
    dirs = [str(inc)]
    staged = ROOT / ".deps" / "usr" / "include"
    if staged.is_dir():
        dirs.append(str(staged))
    dirs += [d for d in os.environ.get("WRITESCOPE_EXTRA_INCLUDE", "").split(os.pathsep) if d]
    if not any((Path(d) / "xsimd" / "xsimd.hpp").is_file() for d in dirs + ["/usr/include", "/usr/local/include"]):
        sys.exit("[writescope setup] xsimd (8.1, header-only) not found: install Debian's libxsimd-dev "
                 "(scripts/install-deps) or point WRITESCOPE_EXTRA_INCLUDE at its include directory")
    return dirs


def nvcc_version():
    home = cpp_extension.CUDA_HOME
    nvcc = Path(home) / "bin" / "nvcc" if home else None
    if nvcc is None or not nvcc.is_file():
        found = shutil.which("nvcc")
        nvcc = Path(found) if found else None
    if nvcc is None:
        return None, None
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return str(nvcc), None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return str(nvcc), (int(m.group(1)), int(m.group(2))) if m else None


def cuda_decision():
    """(build CUDA?, reason shown at build time and kept in the extension)."""
    mode = os.environ.get("WRITESCOPE_CUDA", "auto").lower()
    if mode in ("0", "off", "no"):
        return False, "WRITESCOPE_CUDA=0 at build time"
    torch_cuda = torch.version.cuda
    nvcc, ver = nvcc_version()
    if torch_cuda is None:
        reason = f"torch {torch.__version__} has no CUDA"
    elif nvcc is None:
        reason = "no nvcc found (CUDA_HOME or PATH)"
    elif ver is None:
        reason = f"the version of {nvcc} could not be read"
    elif int(torch_cuda.split(".")[0]) != ver[0]:
        reason = f"torch's CUDA {torch_cuda} and nvcc's {ver[0]}.{ver[1]} ({nvcc}) differ in the major version"
    else:
        return True, f"torch CUDA {torch_cuda}, nvcc {ver[0]}.{ver[1]} ({nvcc})"
    if mode in ("1", "on", "yes"):
        sys.exit(f"[writescope setup] WRITESCOPE_CUDA=1 but the CUDA backend cannot be built: {reason}")
    return False, reason


def c_string(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def extension():
    arch = os.environ.get("WRITESCOPE_CPU_ARCH", "native")
    if arch not in CPU_ARCH_FLAGS:
        sys.exit(f"[writescope setup] WRITESCOPE_CPU_ARCH={arch} is not one of {', '.join(CPU_ARCH_FLAGS)}")
    with_cuda, reason = cuda_decision()
    info = f"CPU arch {arch}; CUDA backend: {'built, ' + reason if with_cuda else 'not built, ' + reason}"
    say(info)
    cxx = ["-std=c++20", "-O2", "-g0", "-DNDEBUG", "-fopenmp", *CPU_ARCH_FLAGS[arch],
           f"-DWRITESCOPE_PY_BUILD_INFO={c_string(info)}"]
    sources = ["csrc/binding.cpp", "csrc/engine_host.cpp"]
    kwargs = dict(include_dirs=include_dirs(), extra_link_args=["-fopenmp"])
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
        say(f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
        sources += ["csrc/engine_cuda.cpp", "csrc/kernels.cu"]
        nvcc = ["-std=c++20", "--expt-relaxed-constexpr", "-O3", "-DNDEBUG"]
        return cpp_extension.CUDAExtension("writescope._C", sources,
                                           extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)
    sources += ["csrc/engine_nocuda.cpp"]
    cxx.append(f"-DWRITESCOPE_PY_NO_CUDA_REASON={c_string(reason)}")
    return cpp_extension.CppExtension("writescope._C", sources, extra_compile_args={"cxx": cxx}, **kwargs)


os.chdir(HERE)
setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
)
