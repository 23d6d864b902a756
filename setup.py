"""Builds csrc/ as one torch extension, `livemoe._C`.

Every csrc/*.cpp is compiled (CPU ops, OpenMP); csrc/*.cu only where a CUDA toolkit and a CUDA build of
torch are both present (with no .cu file it is a plain C++ extension, so a CUDA toolkit that does not
match torch's cannot break the build). Ops register themselves with TORCH_LIBRARY_FRAGMENT(livemoe, ...),
so adding an op is adding a file: nothing here changes. Set LIVEMOE_NO_EXT=1 to install without the
extension (the Python code then falls back to PyTorch). Ninja is used where it is installed, else
setuptools compiles the files one by one. Offline use (a GPU machine): `python setup.py build_ext --inplace`.
"""
import glob
import os
import sys

from setuptools import setup


def extensions():
    if os.environ.get("LIVEMOE_NO_EXT") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension, is_ninja_available

    here = os.path.dirname(os.path.abspath(__file__))
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cu = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    use_cuda = bool(cu) and torch.version.cuda is not None and CUDA_HOME is not None and \
        os.environ.get("LIVEMOE_NO_CUDA") != "1"
    # no -std flag: torch picks the standard its headers need (C++17 up to 2.12, C++20 from 2.13 on)
    cxx = ["-O3"] + ([] if sys.platform == "darwin" else ["-fopenmp"])
    link = [] if sys.platform == "darwin" else ["-fopenmp"]
    include = [os.path.join(here, "csrc")]
    if use_cuda:
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        nvcc = ["-O3", "--use_fast_math", "-lineinfo"]
        if not arch:  # build for the GPU that is here (fast build), else a portable default
            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                suffix = "a" if major == 9 else ""
                nvcc += [f"-gencode=arch=compute_{major}{minor}{suffix},code=sm_{major}{minor}{suffix}"]
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0a"
        ext = CUDAExtension("livemoe._C", cpp + cu, include_dirs=include,
                            define_macros=[("LIVEMOE_WITH_CUDA", "1")],
                            extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=link)
    else:
        ext = CppExtension("livemoe._C", cpp, include_dirs=include,
                           extra_compile_args={"cxx": cxx}, extra_link_args=link)
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=is_ninja_available())}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
