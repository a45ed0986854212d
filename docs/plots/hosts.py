"""Plot GB/s per receiver against the number of hosts H from ``weightsync bench --hosts H --json`` files.

    python docs/plots/hosts.py OUT.png RUN_H2.json RUN_H3.json RUN_H4.json

Each file is one bench run on the testbed; every backend found in them (``auto`` and the baselines) gets a line,
with the link limit (``link_limit_gbps``: no update can cross the sender's link faster) drawn across. Needs
matplotlib (``pip install 'weightsync-cli[plot]'``).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(out: str, paths: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    limits: set[float] = set()
    for path in paths:
        with open(path) as handle:
            run = json.load(handle)
        hosts = int(run["scenario"]["hosts"])
        limits.add(float(run["link_limit_gbps"]))
        for result in run["results"]:
            label = f"{result['backend']} = {result['chosen']}" if result.get("chosen") else result["backend"]
            lines[label].append((hosts, float(result["gbps_p50"])))
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for label, points in sorted(lines.items()):
        points.sort()
        axes.plot([h for h, _ in points], [g for _, g in points], marker="o", label=label)
    for limit in sorted(limits):
        axes.axhline(limit, linestyle="--", color="grey", label=f"link limit {limit:.3f} GB/s")
    axes.set_xlabel("hosts H (sender on host 0, receivers on hosts 1..H-1)")
    axes.set_ylabel("GB/s per receiver (model size / update time)")
    axes.set_xticks(sorted({h for points in lines.values() for h, _ in points}))
    axes.set_ylim(bottom=0)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
