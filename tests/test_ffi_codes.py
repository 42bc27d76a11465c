"""The FFI attribute codes agree between Python (jax_fp4/_src/ffi_codes.py) and C++ (cpp/common/ffi_codes.h).

Parses the header (namespaces, enums and constexpr ints, values written as integers or `1 << n`) and compares every
C++ enumerator with the Python enum member of the same name (kMxfp8E4m3 <-> MXFP8_E4M3: case and underscores
ignored), in both directions, so a code added on one side only fails here. No GPU needed.
"""

from __future__ import annotations

import enum
import pathlib
import re

import pytest

from jax_fp4 import MXFP8, NVFP4
from jax_fp4._src import ffi_codes
from jax_fp4._src.primitives import dequantize as dq_prim
from jax_fp4._src.primitives import grouped as grouped_prim
from jax_fp4._src.primitives import quantize as q_prim

HEADER = pathlib.Path(__file__).resolve().parents[1] / "cpp" / "common" / "ffi_codes.h"

#: C++ (namespace under jax_fp4::codes, enum name) -> the Python enum of the same codes.
ENUMS = {
    ("", "Kind"): ffi_codes.Kind,
    ("quantize", "Option"): ffi_codes.QuantizeOption,
    ("quantize", "Flag"): ffi_codes.QuantizeFlag,
    ("dequantize", "Flag"): ffi_codes.DequantizeFlag,
    ("grouped_dequantize", "Flag"): ffi_codes.GroupedDequantizeFlag,
    ("gemm", "Flag"): ffi_codes.GemmFlag,
}
#: C++ constexpr int -> the Python constant.
CONSTANTS = {("quantize", "kColShift"): ffi_codes.COL_SHIFT, ("quantize", "kOptionMask"): ffi_codes.OPTION_MASK}


def _value(text: str) -> int:
    text = text.strip()
    m = re.fullmatch(r"(\d+|0x[0-9a-fA-F]+)\s*<<\s*(\d+)", text)
    if m:
        return int(m.group(1), 0) << int(m.group(2))
    return int(text, 0)


def _parse(source: str):
    """({(namespace, enum): {enumerator: value}}, {(namespace, name): value}) of the codes namespace."""
    source = re.sub(r"//[^\n]*", "", source)
    enums, consts, stack = {}, {}, []
    token = re.compile(r"namespace\s+(\w+)\s*\{|enum\s+(\w+)\s*:\s*int\s*\{([^}]*)\}\s*;"
                       r"|constexpr\s+int\s+(\w+)\s*=\s*([^;]+);|\}")
    for m in token.finditer(source):
        if m.group(1):
            stack.append(m.group(1))
        elif m.group(2):
            body = {}
            for item in filter(None, (s.strip() for s in m.group(3).split(","))):
                name, value = (s.strip() for s in item.split("="))
                body[name] = _value(value)
            enums[(_inner(stack), m.group(2))] = body
        elif m.group(4):
            consts[(_inner(stack), m.group(4))] = _value(m.group(5))
        else:
            stack.pop()
    return enums, consts


def _inner(stack):
    assert stack[:2] == ["jax_fp4", "codes"], f"code outside jax_fp4::codes: {stack}"
    return "::".join(stack[2:])


def _norm(name: str) -> str:
    return name.removeprefix("k").replace("_", "").lower() if name.startswith("k") else name.replace("_", "").lower()


@pytest.fixture(scope="module")
def header():
    return _parse(HEADER.read_text())


def test_header_parses(header):
    enums, consts = header
    assert set(enums) == set(ENUMS), f"enums in {HEADER.name}: {sorted(enums)}; mapped here: {sorted(ENUMS)}"
    assert set(consts) == set(CONSTANTS), f"constants in {HEADER.name}: {sorted(consts)}"


@pytest.mark.parametrize("where", sorted(ENUMS), ids=lambda w: "::".join(filter(None, w)))
def test_enum_agrees(header, where):
    cpp = {_norm(k): v for k, v in header[0][where].items()}
    py = {_norm(m.name): int(m.value) for m in ENUMS[where]}
    assert cpp == py, f"{where}: C++ {cpp} != Python {ENUMS[where].__name__} {py}"


def test_constants_agree(header):
    for where, value in CONSTANTS.items():
        assert header[1][where] == value, f"{where}: C++ {header[1][where]} != Python {value}"


def test_every_python_enum_is_checked():
    defined = {v for v in vars(ffi_codes).values() if isinstance(v, type) and issubclass(v, enum.Enum)
               and v.__module__ == ffi_codes.__name__}
    assert defined == set(ENUMS.values())


def test_parser_reads_shifts_and_namespaces():
    enums, consts = _parse("namespace jax_fp4 {\nnamespace codes {\nenum A : int { kX = 1, kY = 1 << 4 };  // c\n"
                           "namespace n {\nconstexpr int kZ = 0x10;\n}\n}\n}\n")
    assert enums == {("", "A"): {"kX": 1, "kY": 16}} and consts == {("n", "kZ"): 16}


# The attribute builders of the primitives encode the formats with these codes.
@pytest.mark.parametrize("fmt,kind", [(None, 0), (NVFP4(), 1), (NVFP4(rht=True), 1), (MXFP8(), 2),
                                      (MXFP8(element="e5m2"), 3)])
def test_kind_codes(fmt, kind):
    assert ffi_codes.kind(fmt) == kind
    if fmt is not None:
        assert dq_prim.kind(fmt) == kind


def test_quantize_attributes():
    sr_rht = NVFP4(stochastic_rounding=True, rht=True)
    a = q_prim.ffi_attributes(NVFP4(scaling_2d=True), sr_rht, "swizzled", True, (True, False))
    assert (int(a["row_kind"]), int(a["col_kind"])) == (1, 1)
    assert int(a["flags"]) == 4 | ((1 | 2) << 8) | (1 << 16) | (1 << 17) | (1 << 18)
    a = q_prim.ffi_attributes(NVFP4(local_1x64=True), MXFP8(), "compact", False, (False, True))
    assert (int(a["row_kind"]), int(a["col_kind"]), int(a["flags"])) == (1, 2, 8 | (1 << 19))
    g = grouped_prim.quantize_flags(sr_rht, MXFP8(element="e5m2"), amax_given=2)
    assert (int(g["row_kind"]), int(g["col_kind"]), int(g["flags"]), int(g["amax_given"])) == (1, 3, 3, 2)


def test_dequantize_attributes():
    assert dq_prim.flags(NVFP4(rht=True), "swizzled", False, True) == 2 | (1 << 16) | (1 << 17)
    assert dq_prim.flags(NVFP4(local_1x64=True), "compact", False, False) == 8
    assert dq_prim.flags(MXFP8(), "compact", True, False) == 1 << 18
    g = grouped_prim.dequantize_flags(NVFP4(rht=True), 0, True)
    assert (int(g["kind"]), int(g["flags"])) == (1, 1 | 2 | 4)
    g = grouped_prim.dequantize_flags(MXFP8(), -1, True)
    assert (int(g["kind"]), int(g["flags"])) == (2, 0)
