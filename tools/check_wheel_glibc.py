"""Refuse a wheel whose shared objects need a newer glibc than its manylinux tag promises.

A manylinux_X_Y wheel may only reference glibc symbol versions up to GLIBC_X.Y (PEP 600); a wheel that needs more
installs on an older system and then fails to load its extensions. This check reads the versioned symbol
requirements of every ELF file in the wheel (`readelf -V`, the .gnu.version_r section: one "Name: GLIBC_2.34" entry
per required version) and compares the highest with the tag's.

Usage: python tools/check_wheel_glibc.py WHEEL [WHEEL ...]
  exit 0 and one line per wheel when every tag is met; exit 1 naming the file, the symbol version it needs and the
  tag otherwise (build on an older glibc, e.g. in a manylinux container, or tag the wheel higher).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile

__all__ = ["tag_glibc", "required_glibc", "check_wheel"]

_LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def tag_glibc(wheel_name: str) -> tuple[int, int] | None:
    """The lowest (major, minor) glibc the wheel's platform tags promise to run on (the lowest over its compressed
    tag set: the wheel must meet every tag it carries), or None for a wheel without a manylinux tag."""
    plat = os.path.basename(wheel_name)[:-len(".whl")].split("-")[-1]
    found = []
    for tag in plat.split("."):
        m = re.fullmatch(r"manylinux_(\d+)_(\d+)_\w+", tag)
        if m:
            found.append((int(m.group(1)), int(m.group(2))))
        else:
            legacy = tag.split("_")[0]
            if legacy in _LEGACY:
                found.append(_LEGACY[legacy])
    return min(found) if found else None


def required_glibc(path: str) -> tuple[int, int] | None:
    """The highest GLIBC_x.y symbol version `path` (an ELF file) requires, or None when it requires none.

    Raises:
      RuntimeError: readelf is missing or fails on the file.
    """
    try:
        out = subprocess.run(["readelf", "-V", "--wide", path], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"check_wheel_glibc: readelf -V {path} failed: {e}") from e
    versions = [(int(a), int(b)) for a, b in re.findall(r"Name: GLIBC_(\d+)\.(\d+)", out)]
    return max(versions) if versions else None


def check_wheel(wheel: str) -> list[str]:
    """The violations of `wheel` (empty when its tag is met): one message per ELF file needing a newer glibc."""
    tag = tag_glibc(wheel)
    if tag is None:
        return []
    bad = []
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if not (name.endswith(".so") or ".so." in os.path.basename(name)):
                continue
            path = zf.extract(name, tmp)
            need = required_glibc(path)
            if need is not None and need > tag:
                bad.append(f"{os.path.basename(wheel)}: {name} needs GLIBC_{need[0]}.{need[1]} but the tag promises "
                           f"glibc {tag[0]}.{tag[1]}; build on glibc <= {tag[0]}.{tag[1]} (a manylinux container) "
                           f"or tag the wheel manylinux_{need[0]}_{need[1]}")
    return bad


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    status = 0
    for wheel in argv:
        bad = check_wheel(wheel)
        for msg in bad:
            print(f"check_wheel_glibc: {msg}", file=sys.stderr)
        if bad:
            status = 1
        else:
            tag = tag_glibc(wheel)
            print(f"check_wheel_glibc: {os.path.basename(wheel)}: every shared object meets "
                  + (f"glibc {tag[0]}.{tag[1]}" if tag else "(no manylinux tag)"))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
