"""The README states what the code does: checked against cpp/module.cc, cpp/cpu/module_cpu.cc, the file tree, the
route function and the package's names.

* the CUDA and CPU FFI target lists of the README's feature bullets (and the spelled-out count) equal the targets
  the two extension modules register;
* every path the "Layout" section names exists, and every op family folder of cpp/ is named there;
* every row of the "GEMM routes" table is `jax_fp4.route.gemm_route`'s answer on the three devices of its columns;
* every `jax_fp4.a.b` name in the README and docs/ resolves by attribute access from `import jax_fp4`;
* the README's API table lists each name's parameters (format options, function signatures) as the code has them,
  and every call written `jax_fp4.a.b(p, q)` in the README names parameters the function has, in its order;
* the README's statements about routes (which pairs `implementation="kernel"` puts on `jf4_gemm`, which
  implementations `dense` takes) agree with `gemm_route` and `jax_fp4.dense.IMPLEMENTATIONS`;
* no public docstring holds a measured figure (they name docs/performance.md, where the measurements live);
* the README's Python blocks run as written, in order, in one namespace.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re

import pytest

import jax_fp4
from jax_fp4 import MXFP8, NVFP4
from jax_fp4.route import GemmDevice, gemm_route

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
NUMBERS = {"seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}


def _section(title: str) -> str:
    """The README text under a '## title' or '### title' heading, up to the next heading of any level."""
    m = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", README, re.M | re.S)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def _bullet(start: str) -> str:
    m = re.search(rf"^- {re.escape(start)}.*?(?=^- |^$)", README, re.M | re.S)
    assert m, f"README has no bullet starting {start!r}"
    return m.group(0)


def _registered(path: str) -> set[str]:
    """The target names of the {"name", handler} table of an extension module."""
    return set(re.findall(r'\{"(jf4_\w+)",\s*\w+\}', (ROOT / path).read_text()))


def test_ffi_target_lists_match_the_extension_modules():
    cuda, cpu = _registered("cpp/module.cc"), _registered("cpp/cpu/module_cpu.cc")
    assert cuda and cpu and cpu <= cuda
    cuda_bullet = _bullet("CUDA kernels built with")
    assert set(re.findall(r"`(jf4_\w+)`", cuda_bullet)) == cuda
    count = re.search(r"exposed as (\w+) XLA FFI targets", cuda_bullet)
    assert count and NUMBERS.get(count.group(1)) == len(cuda), count
    assert set(re.findall(r"`(jf4_\w+)`", _bullet("Host C++ kernels for the CPU"))) == cpu


def test_layout_names_existing_paths_and_every_cpp_family():
    layout = _section("Layout")
    named = set()
    for bullet in re.split(r"^- ", layout, flags=re.M)[1:]:
        base = ""
        for token in re.findall(r"`([\w./-]+)`", bullet):
            if "/" not in token and not re.search(r"\.(py|md|sh|cc|toml)$", token):
                continue  # a name, not a path
            if "/" in token and (ROOT / token).exists():  # a path from the root: the base of what follows
                base = token if token.endswith("/") else token.rsplit("/", 1)[0] + "/"
            # a short name is relative to the last path named before it in the bullet, or to the root
            path = next((p for p in (base + token, token) if (ROOT / p).exists()), None)
            assert path, f"README Layout names {token!r} (after {base!r}), which does not exist"
            named.add(path.rstrip("/"))
    inside_cpp = re.search(r"`cpp/` \(([^)]*(?:\([^)]*\)[^)]*)*)\)", layout)
    assert inside_cpp, "README Layout does not describe cpp/"
    families = {p.name for p in (ROOT / "cpp").iterdir() if p.is_dir()}
    listed = set(re.findall(r"`(\w+)/`", inside_cpp.group(1)))
    assert families <= listed, f"cpp/ folders missing from the README Layout: {sorted(families - listed)}"


_FORMATS = {"NVFP4 1D": NVFP4(), "NVFP4 2D": NVFP4(scaling_2d=True), "NVFP4 RHT": NVFP4(rht=True),
            "NVFP4 1×64": NVFP4(local_1x64=True), "MXFP8 E4M3": MXFP8(), "MXFP8 E5M2": MXFP8(element="e5m2")}
_DEVICES = {"CPU": GemmDevice(name="cpu"), "compute capability 9.x with `jf4_gemm`": GemmDevice(kernel=True),
            "compute capability ≥ 10": GemmDevice(block_scaled_tensor_cores=True, scaled_matmul_lowers=True)}


def test_route_table_is_the_route_function():
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in _section("GEMM routes").splitlines()
            if line.startswith("|")]
    header, body = rows[0], rows[2:]
    assert header[0] == "formats" and set(header[1:]) == set(_DEVICES)
    assert len(body) >= 6
    for row in body:
        fa, fb = (_FORMATS[name] for name in row[0].split(" × "))
        for device_name, cell in zip(header[1:], row[1:], strict=True):
            want = gemm_route(fa, fb, "auto", _DEVICES[device_name])
            assert cell == want, f"README route of {row[0]} on {device_name}: {cell}, gemm_route says {want}"


def _resolve(dotted: str):
    obj, parts = jax_fp4, dotted.split(".")[1:]
    for i, part in enumerate(parts):
        if not hasattr(obj, part) and getattr(obj, "__name__", None) == ".".join(["jax_fp4", *parts[:i]]):
            try:  # a submodule not imported by jax_fp4/__init__.py (e.g. jax_fp4.flax.nnx)
                importlib.import_module(".".join(["jax_fp4", *parts[:i + 1]]))
            except ImportError as e:
                pytest.skip(f"{dotted}: {e}")
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))])
def test_names_in_the_docs_resolve(doc):
    names = sorted(set(re.findall(r"`(jax_fp4(?:\.\w+)+)", (ROOT / doc).read_text())))
    if doc == "README.md":
        assert "jax_fp4.route.gemm_route" in names
    for dotted in names:
        try:
            _resolve(dotted)
        except AttributeError as e:
            raise AssertionError(f"{doc} names `{dotted}`, which does not resolve: {e}") from None


def _parameters(obj) -> list[str]:
    """A format's keyword options, or a function's / class's parameter names."""
    if isinstance(obj, type) and issubclass(obj, jax_fp4.Format):
        return list(obj._options)
    return [p for p in inspect.signature(obj).parameters if p != "self"]


def _listed(args: str) -> tuple[list[str], bool]:
    """The parameter names of a README call "(x, fmt, *, axis, ...)" and whether it ends in "..." (a prefix)."""
    names = [a.split("=")[0].strip() for a in args.split(",") if a.strip() not in ("", "*")]
    return [n for n in names if n != "..."], "..." in names


def test_api_table_lists_the_signatures():
    rows = [line.split("|")[1] for line in _section("API").splitlines() if line.startswith("| `")]
    assert len(rows) >= 12
    checked = 0
    for cell in rows:
        for name, args in re.findall(r"`(\w+)\(([^)]*)\)", cell):
            want = _parameters(getattr(jax_fp4, name))
            got, prefix = _listed(args)
            assert got == (want[:len(got)] if prefix else want), f"README API table: {name}({args}); the code: {want}"
            checked += 1
    assert checked >= 15


def test_calls_in_the_readme_name_real_parameters_in_order():
    for dotted, args in re.findall(r"`(jax_fp4(?:\.\w+)+)\(([^)`]*)\)", README):
        got, _ = _listed(args)
        want = _parameters(_resolve(dotted))
        positions = [want.index(n) if n in want else -1 for n in got]
        assert -1 not in positions and positions == sorted(positions), f"README: {dotted}({args}); the code: {want}"


def test_route_statements():
    routes = _section("GEMM routes")
    sentence = re.search(r'`implementation="kernel"` puts every pair but (.*?) on `jf4_gemm`', routes, re.S)
    assert sentence and "1×64 × non-1×64" in sentence.group(1) and "4over6" in sentence.group(1)
    kernel = _DEVICES["compute capability 9.x with `jf4_gemm`"]
    formats = [*_FORMATS.values(), NVFP4(use_4over6=True), NVFP4(use_4over6=True, scaling_2d=True)]
    for fa in formats:
        for fb in formats:
            takes = fa.local_1x64 == fb.local_1x64 and not (fa.use_4over6 or fb.use_4over6)
            assert (gemm_route(fa, fb, "kernel", kernel) == "kernel") == takes, (fa, fb)
    from jax_fp4.dense import IMPLEMENTATIONS
    dense_takes = re.search(r"`dense` takes `implementation`\s+(.*?);", README, re.S)
    assert dense_takes and set(re.findall(r'"(\w+)"', dense_takes.group(1))) == set(IMPLEMENTATIONS)


_MEASURED = re.compile(r"\d(\.\d+)?\s?(TFLOP|GB/s|µs|ms\b)|\d\.\d+\s?[x×]\b|\bon an? [HB]\d00\b")


def test_docstrings_hold_no_measured_figures():
    for path in sorted((ROOT / "jax_fp4").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                m = _MEASURED.search(doc)
                assert not m, (f"{path.relative_to(ROOT)}: {getattr(node, 'name', 'module')} docstring states a "
                               f"measurement ({m.group(0)!r}); link docs/performance.md instead")


def test_readme_python_blocks_run():
    namespace: dict = {}
    blocks = re.findall(r"^```python\n(.*?)^```", README, re.M | re.S)
    assert len(blocks) >= 4
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)  # noqa: S102 - the README's own code
