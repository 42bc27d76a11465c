"""Checks that an optional dependency stays optional: a fresh interpreter imports jax_fp4 (and `also`) without
importing `package`, then, with `package` hidden, `import jax_fp4.<sub>` raises an ImportError naming the extra."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    package, sub, also = sys.argv[1], sys.argv[2], sys.argv[3:]
    import importlib
    import jax_fp4
    for m in also:
        importlib.import_module(m)
    assert package not in sys.modules, f"import jax_fp4 imported {package}"
    sys.modules[package] = None  # as if it were not installed
    try:
        importlib.import_module(f"jax_fp4.{sub}")
    except ImportError as e:
        assert f"pip install jax_fp4[{sub}]" in str(e), e
        print("IMPORT OK")
    """
)


def check_optional_import(package: str, sub: str, also=()):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-P", "-c", SCRIPT, package, sub, *also], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "IMPORT OK" in r.stdout, r.stderr[-4000:]
