"""The compiled train step's memory figures for a spec (abstract shapes; nothing allocated): argument, output,
alias and temp bytes as the compiler reports them on this machine's backend.

    python -m bench.experiments.step_memory SPEC [KEY=VALUE ...]
"""

from __future__ import annotations

import sys
import time


def main(argv=None) -> int:
    from tessera.run.plan_compile import _lowered
    from tessera.spec import load_experiment

    argv = sys.argv[1:] if argv is None else argv
    exp = load_experiment(argv[0], argv[1:])
    t = time.perf_counter()
    lowered = _lowered(exp, True)
    t1 = time.perf_counter()
    stats = lowered.compile().memory_analysis()
    t2 = time.perf_counter()
    gib = {k: getattr(stats, f"{k}_size_in_bytes") / 2**30 for k in ("argument", "output", "alias", "temp")}
    total = gib["argument"] + gib["output"] - gib["alias"] + gib["temp"]
    print(" ".join(f"{k} {v:.2f}" for k, v in gib.items()), f"total {total:.2f} GiB",
          f"(lower {t1 - t:.0f} s, compile {t2 - t1:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
