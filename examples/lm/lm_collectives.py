"""The collectives of a compiled training step, from its HLO text (`compiled.as_text()`): what `train_lm
--collectives` records in summary.json.

Every all-gather, all-reduce, reduce-scatter, all-to-all and collective-permute is counted (an asynchronous one by
its -done op), its bytes being the size of its result (all-gather: the gathered array; reduce-scatter: one shard).
"count" / "bytes" count each op of the module once. "count_per_step" / "bytes_per_step" weight each op by how often
one execution of the module runs it: an op in the body of a while loop with a known trip count (XLA's
`known_trip_count`, e.g. a scanned block stack: one iteration per block) counts that many times, nested loops
multiply, and a loop whose trip count XLA does not know counts once (`loops_without_trip_count` says how many).
"""

from __future__ import annotations

import math
import re

_COLLECTIVE = re.compile(r"=\s*(\([^=]*?\)|[a-z0-9]+\[[\d,]*\](?:\{[^}]*\})?)\s+"
                         r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-done)?\(")
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_BITS = {"pred": 8, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4, "s4": 4, "u4": 4,
         "bf16": 16, "f16": 16, "s16": 16, "u16": 16, "f32": 32, "s32": 32, "u32": 32, "f64": 64, "s64": 64}
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*[ (]")
_CALLEE = re.compile(r"\b(?:calls|to_apply|condition|body)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_WHILE_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_COMMENT = re.compile(r"/\*.*?\*/")  # HLO text numbers long tuples' elements: (a, b, c, d, e, /*index=5*/f, ...)


def _computations(hlo_text: str):
    """[(name, is_entry, [instruction lines])] in the text's order (callees before their callers)."""
    comps, cur = [], None
    for line in hlo_text.splitlines():
        if cur is None:
            m = _HEADER.match(line) if line and not line[0].isspace() and line.rstrip().endswith("{") else None
            if m and not line.startswith("HloModule"):
                cur = (m[2], bool(m[1]), [])
        elif line.startswith("}"):
            comps.append(cur)
            cur = None
        else:
            cur[2].append(line)
    return comps


def _multipliers(comps) -> tuple[dict, int]:
    """{computation: executions per module run} and the number of while loops without a known trip count."""
    mult = {name: 0 for name, _, _ in comps}
    unknown = 0
    for name, entry, _ in comps:
        if entry:
            mult[name] = 1
    for name, _, lines in reversed(comps):  # callers come after their callees in the text
        m = mult.get(name, 0)
        if not m:
            continue
        for line in lines:
            body = _WHILE_BODY.search(line) if " while(" in line else None
            trip = None
            if body:
                t = _TRIP.search(line)
                trip = int(t[1]) if t else None
                unknown += trip is None
            callees = _CALLEE.findall(line)
            for b in _BRANCHES.findall(line):
                callees += [c.strip().lstrip("%") for c in b.split(",") if c.strip()]
            for c in callees:
                if c in mult:
                    mult[c] += m * ((trip or 1) if body and c == body[1] else 1)
    return mult, unknown


def collective_bytes(hlo_text: str) -> dict:
    """{op: {"count", "bytes", "count_per_step", "bytes_per_step"}} of the collectives in a compiled module's HLO
    text, plus "loops_without_trip_count" (an int) when some while loop's trip count is unknown (module
    docstring)."""
    comps = _computations(hlo_text)
    mult, unknown = _multipliers(comps)
    out: dict = {}
    for name, _, lines in comps:
        for m in _COLLECTIVE.finditer(_COMMENT.sub("", "\n".join(lines))):
            op = out.setdefault(m[2], {"count": 0, "bytes": 0, "count_per_step": 0, "bytes_per_step": 0})
            size = 0
            for dtype, dims in _SHAPE.findall(m[1]):
                n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
                size += n * _BITS.get(dtype, 32) // 8
            op["count"] += 1
            op["bytes"] += size
            op["count_per_step"] += mult[name]
            op["bytes_per_step"] += size * mult[name]
    if unknown:
        out["loops_without_trip_count"] = unknown
    return out
