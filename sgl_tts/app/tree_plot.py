"""Draw one problem's search tree (FastTTS Fig. 1 style) from a result's `extra["tree"]`.

Each scored step is a node at its depth, coloured by its verifier score; a node the search expanded further
is kept, a leaf that did not end is pruned (grey); paths that ended are squares, those whose answer is the
selected one are stars; an orange ring marks a step that began with a speculative head start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def layout(nodes: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """(x, y) per node id: x the depth, y in depth-first order of the leaves, a parent centred over its children."""
    children: dict[int | None, list[int]] = {}
    for node in nodes:
        children.setdefault(node["parent"], []).append(node["id"])
    positions: dict[int, tuple[float, float]] = {}
    next_leaf = [0.0]

    def place(node_id: int, depth: int) -> float:
        kids = children.get(node_id, [])
        if kids:
            y = sum(place(kid, depth + 1) for kid in kids) / len(kids)
        else:
            y = next_leaf[0]
            next_leaf[0] += 1
        positions[node_id] = (float(depth), y)
        return y

    for root in children.get(None, []):
        place(root, 1)
    return positions


def plot_tree(tree: dict[str, Any], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = tree["nodes"]
    positions = layout(nodes)
    expanded = {node["parent"] for node in nodes}
    fig, ax = plt.subplots(figsize=(2 + 1.3 * max((n["depth"] for n in nodes), default=1),
                                    1.5 + 0.22 * max(1, sum(1 for n in nodes if n["id"] not in expanded))))
    for node in nodes:
        if node["parent"] is not None:
            (x0, y0), (x1, y1) = positions[node["parent"]], positions[node["id"]]
            alive = node["id"] in expanded or "end" in node
            ax.plot([x0, x1], [y0, y1], color="0.35" if alive else "0.8", lw=1.2 if alive else 0.7, zorder=1)
    cmap = plt.get_cmap("viridis")
    for node in nodes:
        x, y = positions[node["id"]]
        score = node["score"]
        colour = "0.75" if score is None else cmap(score)
        pruned = node["id"] not in expanded and "end" not in node
        marker = "*" if node.get("selected") else "s" if "end" in node else "o"
        ax.scatter([x], [y], s=160 if marker == "*" else 60, marker=marker, c=[colour], zorder=3,
                   edgecolors="orange" if node["head_start"] else ("0.6" if pruned else "black"),
                   linewidths=2 if node["head_start"] else 0.6, alpha=0.45 if pruned else 1.0)
    ax.set_xlabel("step")
    ax.set_xticks(range(1, max((n["depth"] for n in nodes), default=1) + 1))
    ax.set_yticks([])
    ax.set_title(title or "search tree", fontsize=9)
    handles = [plt.Line2D([], [], marker="o", ls="", color="0.5", label="kept (expanded)"),
               plt.Line2D([], [], marker="o", ls="", color="0.85", label="pruned"),
               plt.Line2D([], [], marker="s", ls="", color="0.5", label="ended"),
               plt.Line2D([], [], marker="*", ls="", color="0.5", markersize=11, label="selected answer"),
               plt.Line2D([], [], marker="o", ls="", mfc="white", mec="orange", mew=2, label="speculative head start")]
    fig.colorbar(plt.cm.ScalarMappable(cmap=cmap), ax=ax, label="step score", fraction=0.04, pad=0.02)
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.12, 1.0))
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
