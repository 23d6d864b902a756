"""Static resources of a Triton kernel launch on sm_90a (H100/H200), found with no GPU: the launch is compiled as
Triton's JIT would compile it (same signature, constants and divisibility hints for its argument values),
then `cuobjdump -res-usage` (shipped with Triton's NVIDIA backend) reads registers and stack bytes (local
memory, where spilled registers go) from the cubin, and Triton's metadata gives the shared memory. From
those, the theoretical occupancy: resident warps per SM.

`specialize` matters: an int equal to 1 becomes a constant, and a multiple of 16 (as every tensor, 16-byte
aligned by torch's allocator) carries the hint that lets loads vectorise. Compiled without those hints
(every element then holds its own 64-bit address) the MoE GEMMs hit 255 registers and spill; as launched,
they do not.
"""
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import torch


@dataclass
class Launch:
    family: str  # "moe", "logprobs", "attention": which compile test owns it
    case: str  # the shape and dtype it stands for
    dtype: torch.dtype  # the model's dtype (16-bit launches must not spill)
    fn: object  # the @triton.jit function
    args: dict  # every parameter of fn by name: ints, floats, bools, constexpr values, torch dtypes for tensors
    num_warps: int = 4  # Triton's launch defaults where the host code gives none
    num_stages: int = 3
    extra: dict = field(default_factory=dict)  # shapes for the roofline model

    @property
    def kernel(self) -> str:
        return self.fn.__name__

    @property
    def name(self) -> str:
        return f"{self.kernel} {self.case}"


def specialize(fn, args: dict, hints: bool = True):
    """-> (signature, constexprs, attrs) as the JIT makes them for these argument values. hints=False gives
    the bare signature (no constants from ints equal to 1, no divisibility): what the old compile tests built."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import MockTensor
    except ImportError:  # older triton: the same rules, written out
        native_specialize_impl = None
    missing = set(fn.arg_names) ^ set(args)
    assert not missing, f"{fn.__name__}: arguments given and taken differ: {sorted(missing)}"
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = args[name]
        if param.is_constexpr:
            signature[name], constexprs[(i,)] = "constexpr", value
            continue
        if not hints:
            ty, spec = _specialize_fallback(value)
            ty, spec = ("i32" if ty == "constexpr" else ty), None
        elif native_specialize_impl is not None:
            arg = MockTensor(value) if isinstance(value, torch.dtype) else value
            ty, spec = native_specialize_impl(BaseBackend, arg, False, not param.do_not_specialize, True)
        else:
            ty, spec = _specialize_fallback(value)
        if ty == "constexpr":
            signature[name], constexprs[(i,)] = "constexpr", value
        else:
            signature[name] = ty
            if spec:
                attrs[(i,)] = [["tt.divisibility", 16]] if "D" in spec else []
    return signature, constexprs, attrs


def _specialize_fallback(value):
    if isinstance(value, torch.dtype):
        return "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                      torch.int64: "i64"}[value], "D"
    if isinstance(value, bool):
        return "u1", None
    if isinstance(value, float):
        return "fp32", None
    if value == 1:
        return "constexpr", 1
    return ("i32" if -2**31 <= value < 2**31 else "i64"), ("D" if value % 16 == 0 else "")


# sm_90 per SM (CUDA occupancy calculator, compute capability 9.0)
REGS_PER_SM = 65536
REG_ALLOC_UNIT = 256  # registers are granted per warp in units of 256
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
SMEM_PER_SM = 228 * 1024
SMEM_PER_BLOCK = 227 * 1024  # the most one block may use
SMEM_RESERVED_PER_BLOCK = 1024  # the driver's per-block reservation
SM90 = ("cuda", 90, 32)
SIXTEEN_BIT = ("bfloat16", "float16")  # the dtypes the GPU runs: their launches must not spill


@dataclass
class Resources:
    kernel: str
    case: str
    family: str
    dtype: str
    num_warps: int
    num_stages: int
    registers: int
    stack_bytes: int
    shared_bytes: int  # dynamic (Triton's) + static
    occupancy_warps: int  # resident warps per SM
    limited_by: str
    error: str = ""

    @property
    def occupancy(self) -> float:
        return self.occupancy_warps / MAX_WARPS_PER_SM


def cuobjdump_path() -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.access(path, os.X_OK) else None


def res_usage(cubin: bytes) -> dict:
    """{'REG': n, 'STACK': n, 'SHARED': n, 'LOCAL': n} of the cubin's one kernel, from cuobjdump -res-usage."""
    tool = cuobjdump_path()
    if tool is None:
        raise RuntimeError("cuobjdump is not in this triton's NVIDIA backend (triton/backends/nvidia/bin)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return parse_res_usage(text)


def parse_res_usage(text: str) -> dict:
    lines = [line for line in text.splitlines() if "REG:" in line]
    assert len(lines) == 1, f"expected one kernel in cuobjdump's output, got:\n{text}"
    return {k: int(v) for k, v in re.findall(r"([A-Z]+):(\d+)", lines[0])}


def occupancy(registers: int, shared_bytes: int, num_warps: int) -> tuple[int, str]:
    """(resident warps per SM, the resource that limits them) on sm_90."""
    regs_per_warp = -(-registers * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    limits = {
        "registers": (REGS_PER_SM // regs_per_warp) // num_warps if registers else MAX_BLOCKS_PER_SM,
        "shared memory": SMEM_PER_SM // (shared_bytes + SMEM_RESERVED_PER_BLOCK),
        "warps": MAX_WARPS_PER_SM // num_warps,
        "blocks": MAX_BLOCKS_PER_SM,
    }
    by = min(limits, key=limits.get)
    return limits[by] * num_warps, by


def compile_sm90(launch, hints: bool = True):
    """The compiled kernel (triton's CompiledKernel) for sm_90a, specialised as the JIT would at launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialize(launch.fn, launch.args, hints)
    return triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=GPUTarget(*SM90),
                          options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))


def measure_launch(launch, hints: bool = True) -> Resources:
    dtype = str(launch.dtype).removeprefix("torch.")
    base = dict(kernel=launch.kernel, case=launch.case, family=launch.family, dtype=dtype,
                num_warps=launch.num_warps, num_stages=launch.num_stages)
    try:
        kernel = compile_sm90(launch, hints)
    except Exception as e:  # noqa: BLE001  (a kernel that does not compile is a row of the report)
        return Resources(**base, registers=0, stack_bytes=0, shared_bytes=0, occupancy_warps=0, limited_by="",
                         error=f"{type(e).__name__}: {str(e)[:800]}")
    res = res_usage(kernel.asm["cubin"])
    shared = kernel.metadata.shared + res.get("SHARED", 0)
    warps, by = occupancy(res["REG"], shared, launch.num_warps)
    error = f"{shared} bytes of shared memory > {SMEM_PER_BLOCK}" if shared > SMEM_PER_BLOCK else ""
    return Resources(**base, registers=res["REG"], stack_bytes=res["STACK"], shared_bytes=shared,
                     occupancy_warps=warps, limited_by=by, error=error)


def problems(rows: list[Resources]) -> list[str]:
    """What the compile tests fail on: a kernel that does not compile or overflows shared memory, and a
    16-bit launch that spills (stack > 0)."""
    out = [f"{r.kernel} {r.case}: {r.error}" for r in rows if r.error]
    out += [f"{r.kernel} {r.case}: {r.stack_bytes} stack bytes at {r.registers} registers"
            for r in rows if not r.error and r.dtype in SIXTEEN_BIT and r.stack_bytes]
    return out
