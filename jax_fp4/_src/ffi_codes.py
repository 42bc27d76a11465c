"""The FFI attribute codes the primitives pass to the kernels: format kinds and flag bits.

Defined once here for Python and once in cpp/common/ffi_codes.h for C++; tests/test_ffi_codes.py parses the header
and checks that the two agree (same enumerators, same values).
"""

from __future__ import annotations

import enum

__all__ = ["COL_SHIFT", "OPTION_MASK", "DequantizeFlag", "GemmFlag", "GroupedDequantizeFlag", "Kind", "QuantizeFlag",
           "QuantizeOption", "kind", "quantize_options"]


class Kind(enum.IntEnum):
    """Format of an operand (the row_kind / col_kind / kind attributes); C++ `codes::Kind`."""

    NONE = 0
    NVFP4 = 1
    MXFP8_E4M3 = 2
    MXFP8_E5M2 = 3


class QuantizeOption(enum.IntFlag):
    """NVFP4 options of one jf4_quantize / jf4_grouped_quantize orientation; C++ `codes::quantize::Option`."""

    SR = 1
    RHT = 2
    SCALING_2D = 4
    LOCAL_1X64 = 8
    USE_4OVER6 = 16  # 4over6 block selection (NVFP4(use_4over6=True))
    E4M3_MAX_256 = 32  # the tensor scale on the E4M3 bound 256 (NVFP4.global_e4m3_max)
    ERR_MSE = 64  # 4over6 candidate error: squared differences (err_mode_4over6="MSE")


COL_SHIFT = 8  # flags = row options | col options << COL_SHIFT | QuantizeFlag bits (C++ codes::quantize::kColShift)
OPTION_MASK = 0xFF  # one orientation's options (C++ codes::quantize::kOptionMask)


class QuantizeFlag(enum.IntFlag):
    """jf4_quantize flag bits above the two option bytes; C++ `codes::quantize::Flag`."""

    SWIZZLED = 1 << 16
    DBIAS = 1 << 17
    ROW_EXACT = 1 << 18
    COL_EXACT = 1 << 19


class DequantizeFlag(enum.IntFlag):
    """jf4_dequantize flags; C++ `codes::dequantize::Flag`. BLOCK_ONLY is set by the handler from an empty amax
    operand, never passed."""

    RHT = 2
    LOCAL_1X64 = 8
    E4M3_MAX_256 = 32  # NVFP4 tensor scale on the E4M3 bound 256: amax * fp32(1/1536)
    SWIZZLED = 1 << 16
    TRANSPOSE_OUT = 1 << 17
    MX_COLUMNWISE = 1 << 18
    BLOCK_ONLY = 1 << 19


class GroupedDequantizeFlag(enum.IntFlag):
    """jf4_grouped_dequantize flags; C++ `codes::grouped_dequantize::Flag`."""

    COLUMNWISE = 1
    RHT = 2
    RAW = 4
    E4M3_MAX_256 = 32  # NVFP4 tensor scales on the E4M3 bound 256: amax * fp32(1/1536)


class GemmFlag(enum.IntFlag):
    """jf4_gemm flags; C++ `codes::gemm::Flag`: the operands with NVFP4 1x64 window scales (they pair only with each
    other) and EMIT_AMAX (the epilogue writes max |out|, NaN if any output is NaN, to its out_amax result)."""

    A_LOCAL_1X64 = 1
    B_LOCAL_1X64 = 2
    EMIT_AMAX = 4


def kind(fmt) -> int:
    """The Kind code of a format spec (None: Kind.NONE, an absent orientation)."""
    return Kind.NONE if fmt is None else fmt.kind_code


def quantize_options(fmt, supported: QuantizeOption | None = None) -> int:
    """The QuantizeOption bits of one orientation's format (0 for None and MXFP8), restricted to `supported` (None:
    all of them)."""
    if fmt is None:
        return 0
    opts = ((QuantizeOption.SR if fmt.stochastic_rounding else 0) | (QuantizeOption.RHT if fmt.rht else 0)
            | (QuantizeOption.SCALING_2D if fmt.scaling_2d else 0)
            | (QuantizeOption.LOCAL_1X64 if fmt.local_1x64 else 0)
            | (QuantizeOption.USE_4OVER6 if fmt.use_4over6 else 0)
            | (QuantizeOption.E4M3_MAX_256 if fmt.has_tensor_amax and fmt.global_e4m3_max == 256 else 0)
            | (QuantizeOption.ERR_MSE if fmt.use_4over6 and fmt.err_mode_4over6 == "MSE" else 0))
    return int(opts if supported is None else opts & supported)
