"""Plot of expert bytes read per token against cache size, one line per policy, one token's working set marked."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from weightstream.sim.replay import Result

MIB, GIB = 2**20, 2**30


def plot_results(results: Sequence[Result], working_set_bytes: int, out: str | Path, title: str = "") -> None:
    """Write a PNG of MiB read per token vs cache size (GiB) to `out`."""
    fig, ax = _figure()
    for policy in dict.fromkeys(r.policy for r in results):
        rows = sorted((r for r in results if r.policy == policy), key=lambda r: r.cache_bytes)
        ax.plot(
            [r.cache_bytes / GIB for r in rows],
            [r.bytes_per_token / MIB for r in rows],
            marker="o" if len(rows) < 20 else None,
            markersize=3,
            label=policy,
        )
    ax.axvline(working_set_bytes / GIB, color="grey", linestyle="--", linewidth=1)
    ax.annotate(
        f"1x = one token's working set ({working_set_bytes / GIB:.2f} GiB)",
        (working_set_bytes / GIB, ax.get_ylim()[1]),
        xytext=(4, -12),
        textcoords="offset points",
        fontsize=8,
        color="grey",
    )
    _save(fig, ax, "expert MiB read per token", title, out)


def plot_predictions(configs: Sequence[dict], working_set_bytes: int, out: str | Path, title: str = "") -> None:
    """Write a PNG of `tune`'s predicted decode tok/s against expert cache size, one line per policy, the page
    cache (which uses the whole expert budget) as a horizontal line."""
    fig, ax = _figure()
    expert = [c for c in configs if c["path"] == "expert-cache" and c["predicted_decode_tokens_per_s"]]
    for policy in dict.fromkeys(c["policy"] for c in expert):
        rows = sorted((c for c in expert if c["policy"] == policy), key=lambda c: c["cache_bytes"])
        style = {"linestyle": "--", "color": "black"} if rows[0]["bound"] else {}
        ax.plot(
            [c["cache_bytes"] / GIB for c in rows],
            [c["predicted_decode_tokens_per_s"] for c in rows],
            marker="o",
            markersize=3,
            label=f"{policy} (bound)" if rows[0]["bound"] else policy,
            **style,
        )
    for c in configs:
        if c["path"] == "page-cache" and c["predicted_decode_tokens_per_s"]:
            ax.axhline(c["predicted_decode_tokens_per_s"], color="grey", linestyle=":", label="page cache (all of it)")
    ax.axvline(working_set_bytes / GIB, color="grey", linestyle="--", linewidth=1)
    _save(fig, ax, "predicted decode tok/s", title, out)


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7.5, 4.5), dpi=120)


def _save(fig, ax, ylabel: str, title: str, out: str | Path) -> None:
    """Both plots' axes, legend and file: cache size in GiB across, `ylabel` up from 0."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("expert cache size (GiB)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
