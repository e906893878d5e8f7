"""Matmul and convolution flops of a compiled program, read from its HLO, for backends whose
executables report none (XLA's GPU compiler: `cost_analysis()` is None).

Counted: `dot`s (also inside fusions, such as XLA's Triton GEMM fusions), cuBLAS GEMM
custom calls, `convolution`s and cuDNN convolution custom calls, each 2 flops per
multiply-add, and the flops a compiled kernel declares (Pallas' `cost_estimate`), once
per execution (a while body's once per trip). Not counted: elementwise
and reduction ops, which are bound by memory bandwidth, not the matmul peak. The result is
keyed by the operands' element type, so each can be priced at its own peak.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import TYPE_CHECKING

from xla_strategies.hardware.hlo import (
    ARRAY_TYPE,
    CALLEE,
    FUSIONS,
    OPERAND,
    Op,
    computations,
    operand_text,
)
from xla_strategies.hardware.hlo_loops import executions, step_total

if TYPE_CHECKING:
    from xla_strategies.hardware.topology import Topology

_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CUBLAS_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
_CONV_TARGETS = {  # where the forward output and the kernel are: (result or operand index)
    "__cudnn$convForward": ("result", 1),
    "__cudnn$convBiasActivationForward": ("result", 1),
    "__cudnn$convBackwardInput": (0, 1),
    "__cudnn$convBackwardFilter": (1, "result"),
}


def hlo_flops(hlo_text: str) -> Counter[str]:
    """Flops one step runs, by element type (`bf16`, `f32`, ...)."""
    comps, entry = computations(hlo_text)
    return step_total(
        comps,
        entry,
        lambda name: _computation_flops(name, comps),
        rank=lambda flops: sum(flops.values()),
    )


#: Custom calls to compiled kernels (Pallas on TPU through Mosaic, Pallas on GPU through
#: Triton) whose work the HLO does not show, unless the kernel declares it: a Pallas
#: kernel's `cost_estimate=pl.CostEstimate(...)` is kept in its backend config.
_KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "mosaic_gpu")
_DECLARED = re.compile(r'"cost_estimate":\{([^}]*)\}')
_DECLARED_FIELD = re.compile(r'"(\w+)":"?(\d+)"?')


def declared_cost(opcode: str, rest: str) -> dict[str, int] | None:
    """What a compiled kernel declares it costs (`flops`, `bytes_accessed`, ...); None for
    any other instruction, or a kernel that declares nothing."""
    if opcode != "custom-call" or not _is_kernel(rest):
        return None
    found = _DECLARED.search(rest)
    return {k: int(v) for k, v in _DECLARED_FIELD.findall(found.group(1))} if found else None


def opaque_kernel_calls(hlo_text: str) -> int:
    """Calls per step of kernels whose flops `hlo_flops` cannot count (see
    `_KERNEL_TARGETS`; they declare no cost): a compute estimate from the HLO leaves them
    out, and says so."""
    comps, entry = computations(hlo_text)
    return sum(
        times
        for name, times in executions(comps, entry).items()
        for _, _, opcode, rest in comps.get(name, [])
        if opcode == "custom-call" and _is_kernel(rest) and declared_cost(opcode, rest) is None
    )


def _is_kernel(rest: str) -> bool:
    target = _TARGET.search(rest)
    return bool(target) and target.group(1) in _KERNEL_TARGETS


_HALF_WIDTH = ("bf16", "f16", "f8e4m3fn", "f8e5m2")


def matmul_seconds(flops_by_dtype: dict[str, float], topology: Topology | None) -> float | None:
    """The matmul flops at the device's peaks: bf16, f16 and fp8 operands at its dense bf16
    peak, every wider type at its f32 matmul peak (TF32 tensor cores on GPUs, where XLA's
    default precision runs f32 dots). None where the topology knows no peak."""
    if topology is None or not topology.peak_flops:
        return None
    peak = topology.peak_flops
    wide = topology.peak_f32_flops or peak
    return sum(f / (peak if d in _HALF_WIDTH else wide) for d, f in flops_by_dtype.items())


def _computation_flops(name: str, comps: dict[str, list[Op]]) -> Counter[str]:
    ops = comps.get(name, [])
    types = {op_name: op_types for op_name, op_types, _, _ in ops}
    found: Counter[str] = Counter()
    for op in ops:
        found.update(instruction_flops(op, comps, types))
    return found


def instruction_flops(op: Op, comps: dict[str, list[Op]], types: dict[str, str]) -> Counter[str]:
    """The matmul flops of one execution of `op` (a fusion's: its fused computation's), by
    element type; `types`: the result types of its computation's instructions."""
    _, op_types, opcode, rest = op
    if opcode in FUSIONS:
        found: Counter[str] = Counter()
        for callee in CALLEE.findall(rest):
            found.update(_computation_flops(callee, comps))
        return found
    counted = _op_flops(opcode, op_types, rest, types)
    return Counter({counted[0]: counted[1]}) if counted else Counter()


def _op_flops(opcode: str, result: str, rest: str, types: dict[str, str]) -> tuple[str, int] | None:
    operands = _operand_types(rest, types)
    if opcode == "dot" and operands:
        return _matmul(result, operands[0], _CONTRACTING.search(rest))
    if opcode == "convolution" and len(operands) >= 2:
        return _convolution(result, operands[1], rest, operands[0])
    if opcode != "custom-call" or not (target := _TARGET.search(rest)):
        return None
    declared = declared_cost(opcode, rest)
    if declared and declared.get("flops"):  # priced at its operands' type's peak
        return _dtype(operands[0] if operands else result), declared["flops"]
    if target.group(1) in _GEMM_TARGETS and operands:
        return _matmul(result, operands[0], _CUBLAS_CONTRACTING.search(rest))
    where = _CONV_TARGETS.get(target.group(1))
    if where is None or len(operands) < 2:
        return None
    output, kernel = (result if w == "result" else operands[w] for w in where)
    return _convolution(output, kernel, rest, operands[0])


def _matmul(result: str, lhs: str, contracting: re.Match | None) -> tuple[str, int] | None:
    result_dims, lhs_dims = _dims(result), _dims(lhs)
    if result_dims is None or lhs_dims is None or contracting is None:
        return None
    axes = [int(d.strip('" ')) for d in contracting.group(1).split(",") if d.strip('" ')]
    depth = math.prod(lhs_dims[a] for a in axes)
    return _dtype(lhs), 2 * math.prod(result_dims) * depth


def _convolution(output: str, kernel: str, rest: str, lhs: str) -> tuple[str, int] | None:
    """2 x the multiply-adds: for each output element, the kernel's input features times
    the window taps that land on input (not padding or dilation holes). XLA writes batched
    matmuls as convolutions whose window spans a whole padded dimension, where only one
    tap per output lands on input."""
    output_dims, kernel_dims, lhs_dims = _dims(output), _dims(kernel), _dims(lhs)
    labels = _DIM_LABELS.search(rest)
    if output_dims is None or kernel_dims is None or lhs_dims is None or labels is None:
        return None
    lhs_labels, kernel_labels, out_labels = labels.group(1), labels.group(2), labels.group(3)
    window = _window(rest)
    macs = math.prod(output_dims) * kernel_dims[kernel_labels.index("i")]
    for n, digit in enumerate(sorted(c for c in kernel_labels if c.isdigit())):
        size = kernel_dims[kernel_labels.index(digit)]
        out = output_dims[out_labels.index(digit)]
        given = {key: values[n] for key, values in window.items() if n < len(values)}
        taps = _taps(lhs_dims[lhs_labels.index(digit)], size, out, given)
        macs = macs * taps // max(out, 1)
    return _dtype(lhs), 2 * macs


def _window(rest: str) -> dict[str, list[str]]:
    """A convolution's window attributes, per spatial dimension (`size=3x3 pad=1_1x1_1`)."""
    found = _WINDOW.search(rest)
    if not found:
        return {}
    return {
        key: value.split("x")
        for key, value in (item.split("=", 1) for item in found.group(1).split() if "=" in item)
    }


def _taps(in_size: int, size: int, out: int, window: dict[str, str]) -> int:
    """The (output position, window tap) pairs of one spatial dimension that read input."""
    low = int(window.get("pad", "0_0").split("_")[0])
    stride = int(window.get("stride", "1"))
    lhs_dilate = int(window.get("lhs_dilate", "1"))
    rhs_dilate = int(window.get("rhs_dilate", "1"))
    taps = 0
    for tap in range(size):
        offset = tap * rhs_dilate - low  # input position of output 0 through this tap
        if lhs_dilate == 1:  # the outputs whose position lands in [0, in_size)
            first = max(0, -(offset // stride) if offset < 0 else 0)
            first = max(first, (-offset + stride - 1) // stride)
            last = min(out - 1, (in_size - 1 - offset) // stride)
            taps += max(0, last - first + 1)
            continue
        taps += sum(
            1
            for position in range(out)
            if (at := position * stride + offset) >= 0
            and at % lhs_dilate == 0
            and at // lhs_dilate < in_size
        )
    return taps


def _operand_types(rest: str, types: dict[str, str]) -> list[str]:
    """Each operand's type: printed beside it, or its defining instruction's."""
    inside = operand_text(rest)
    found = []
    for part in inside.split(", "):
        if "[" in part:
            found.append(part)
        elif names := OPERAND.findall(part):
            found.append(types.get(names[0], ""))
    return found


def _dims(types: str) -> list[int] | None:
    first = ARRAY_TYPE.search(types)
    return [int(d) for d in first.group(2).split(",") if d] if first else None


def _dtype(types: str) -> str:
    first = ARRAY_TYPE.search(types)
    return first.group(1) if first else "unknown"
