"""Draw the figures of docs/concepts.md: `python docs/figures/make_figures.py`."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent

# A depth-3, topk-2 dynamic tree: (token, parent index, cumulative log prob).
NODES = [
    ("the", -1, 0.0),
    ("cat", 0, -0.2),
    ("dog", 0, -1.1),
    ("sat", 1, -0.5),
    ("ran", 1, -1.4),
    ("sat", 2, -1.6),
    ("on", 3, -0.7),
    ("down", 3, -1.3),
]
ACCEPTED = {0, 1, 3, 6}


def draw_tree(path: Path) -> None:
    depth = {0: 0}
    for i, (_, parent, _) in enumerate(NODES[1:], start=1):
        depth[i] = depth[parent] + 1
    rows: dict[int, list[int]] = {}
    for i, d in depth.items():
        rows.setdefault(d, []).append(i)
    pos = {
        i: (d, -r + (len(rows[d]) - 1) / 2) for d, ids in rows.items() for r, i in enumerate(ids)
    }
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, (_, parent, _) in enumerate(NODES):
        if parent >= 0:
            (x0, y0), (x1, y1) = pos[parent], pos[i]
            color = "tab:green" if i in ACCEPTED and parent in ACCEPTED else "0.7"
            ax.plot([x0, x1], [y0, y1], color=color, lw=2, zorder=1)
    for i, (token, _, score) in enumerate(NODES):
        x, y = pos[i]
        face = "tab:green" if i in ACCEPTED else "white"
        ax.scatter([x], [y], s=900, c=face, edgecolors="black", zorder=2)
        ax.annotate(token, (x, y), ha="center", va="center", fontsize=9, zorder=3)
        if i:
            ax.annotate(f"{score:.1f}", (x, y - 0.38), ha="center", fontsize=7, color="0.3")
    ax.set_xticks(range(len(rows)), ["root"] + [f"depth {d}" for d in range(1, len(rows))])
    ax.set_yticks([])
    ax.set_title(
        "Draft tree, topk=2 (green: the path the target accepted; numbers: cumulative log p)",
        fontsize=9,
    )
    ax.margins(x=0.08, y=0.25)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw_tree(HERE / "draft_tree.png")
    print(HERE / "draft_tree.png")
