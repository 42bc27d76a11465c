"""Tabulates an A/B timing log of the kernel_check harnesses: `== NAME round R` headers followed by a harness's
`time` output. One row per variant and shape, one column per build, the rounds' % of copy joined by '/'.

Usage: python tools/dev/kernel_check/ab_table.py TIME_LOG
"""

import collections
import re
import sys


def main(path: str) -> None:
    res = collections.defaultdict(list)
    builds, variants, cases = [], [], []
    build = case = None
    for line in open(path):
        m = re.match(r"== (\S+) round", line)
        if m:
            build = m.group(1)
            builds += [build] if build not in builds else []
            continue
        m = re.match(r"\[(.*)\] copy", line)
        if m:
            case = m.group(1)
            cases += [case] if case not in cases else []
            continue
        m = re.match(r"  (.+?)\s+[\d.]+ us .* ([\d.]+)% of copy", line)
        if m:
            name = m.group(1).strip()
            variants += [name] if name not in variants else []
            res[(case, name, build)].append(float(m.group(2)))
    print(f"{'variant':<32} {'case':<20}" + "".join(f"{b:>14}" for b in builds))
    for v in variants:
        for c in cases:
            cells = ["/".join(f"{x:.1f}" for x in res[(c, v, b)]) for b in builds]
            print(f"{v:<32} {c:<20}" + "".join(f"{x:>14}" for x in cells))


if __name__ == "__main__":
    main(sys.argv[1])
