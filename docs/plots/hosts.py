"""Plot GB/s per receiver against the number of hosts H, or of rails K, from ``weightsync bench --hosts H [--rails K]
--json`` files.

    python docs/plots/hosts.py OUT.png RUN_H2.json RUN_H3.json RUN_H4.json
    python docs/plots/hosts.py OUT.png RUN_K1.json RUN_K2.json RUN_K4.json

Each file is one bench run on the testbed; the runs differ in H or in K (that is the x axis). Every backend found in
them (``auto`` and the baselines) gets a line. Two ceilings are drawn: the sender host's links (``link_limit_gbps``:
K rails of ``link_gbps``; no update can leave the sender's host faster) and, for rails, this machine's CPU
(``limit_gbps``: what its cores copy per receiver, the most any transport delivers here whatever the links). Needs
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

    runs = []
    for path in paths:
        with open(path) as handle:
            runs.append(json.load(handle))
    by_rails = len({run["scenario"].get("rails", 1) for run in runs}) > 1
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    links: list[tuple[int, float]] = []
    for run in runs:
        x = int(run["scenario"]["rails" if by_rails else "hosts"])
        links.append((x, float(run["link_limit_gbps"])))
        for result in run["results"]:
            label = f"{result['backend']} = {result['chosen']}" if result.get("chosen") and not by_rails \
                else result["backend"]
            lines[label].append((x, float(result["gbps_p50"])))
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for label, points in sorted(lines.items()):
        points.sort()
        axes.plot([x for x, _ in points], [g for _, g in points], marker="o", label=label)
    links.sort()
    if by_rails:
        axes.plot([x for x, _ in links], [g for _, g in links], linestyle="--", color="grey",
                  label="links of the sender's host (K x link)")
        cpu = min(float(run["limit_gbps"]) for run in runs)
        axes.axhline(cpu, linestyle=":", color="red", label=f"CPU ceiling {cpu:.2f} GB/s (copy per receiver)")
        axes.set_yscale("log")
    else:
        for limit in sorted({g for _, g in links}):
            axes.axhline(limit, linestyle="--", color="grey", label=f"link limit {limit:.3f} GB/s")
        axes.set_ylim(bottom=0)
    axes.set_xlabel("rails K per host (one stripe per rail)" if by_rails
                    else "hosts H (sender on host 0, receivers on hosts 1..H-1)")
    axes.set_ylabel("GB/s per receiver (model size / update time)")
    axes.set_xticks(sorted({x for x, _ in links}))
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3, which="both")
    figure.tight_layout()
    figure.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
