"""The changed fraction of ``weightsync bench --mix rl``'s versions against the learning rate, as a Markdown table.

    python docs/plots/rl_lr.py [MODEL_MIB] [LR ...]

For each learning rate: the bf16 decoder of ``--mix rl`` (default 256 MiB), six versions one Adam step apart
(what a bench run with ``--repeat 5`` sends: a warm-up, then five timed updates), and the bytes of each timed
version that differ bitwise from the one before, over S, averaged — ``scenario.changed_fraction``.
"""

from __future__ import annotations

import sys

from weightsync.cli.bench.rl import make_versions

LRS = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3)


def main(model_mib: float, lrs: list[float]) -> None:
    print("| lr | changed fraction (mean of 5 steps) | per step |")
    print("|---|---|---|")
    for lr in lrs:
        versions = make_versions(int(model_mib * 2**20), 6, lr=lr)
        try:
            steps = [versions.changed[k] / versions.total_bytes for k in range(1, 6)]
            print(f"| {lr:g} | {versions.changed_fraction(range(1, 6)):.2%} | "
                  f"{', '.join(f'{step:.2%}' for step in steps)} |", flush=True)
        finally:
            versions.remove()


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 256.0, [float(value) for value in sys.argv[2:]] or list(LRS))
