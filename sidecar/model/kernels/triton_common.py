"""Pieces shared by the Triton kernels. Imports Triton: import it only where ``gpu_paths.triton_available()``.

``mma(a, b, F32)`` is the kernels' one matrix product, accumulating in float32. With ``F32`` both operands
are taken to float32 and multiplied at full precision (``input_precision="ieee"``: no TF32 rounding, so a
float32 model gets float32 answers). Without it 16-bit operands go to the tensor cores as they are.
``F32`` is also forced under the interpreter, whose ``tl.dot`` multiplies bf16 operands' raw bits as
integers; there the operands are rounded to their 16-bit dtype first, so the interpreter sees the same
inputs a GPU would.
"""
import torch
import triton
import triton.language as tl

from sidecar.model.kernels.gpu_paths import triton_interpreted


@triton.jit
def mma(a, b, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


def dot_in_f32(dtype: torch.dtype) -> bool:
    """The ``F32`` argument of ``mma`` for operands of ``dtype``."""
    return dtype == torch.float32 or triton_interpreted()
