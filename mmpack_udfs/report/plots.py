"""The packing report's plots, as PNG bytes: what a user needs to choose a budget and to
trust the packing. Each takes the shards' per-bin figures (``pack_report.read_figures``);
matplotlib is imported here only (driver side, Agg backend).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mmpack_udfs.pack import costs

LENGTHS_PLOT, TOKENS_PLOT, SUPERVISED_PLOT = "lengths.png", "bin_tokens.png", "bin_supervised.png"
ATTENTION_PLOT, PATCHES_PLOT, COST_PLOT = "bin_attention.png", "bin_patches.png", "bin_cost.png"
MODALITIES = ("text only", "with images", "with video")  # a sample's kind: its richest media
COLORS = {"text": "#3b75af", "image": "#ef8636", "video": "#519e3e", "budget": "#c03d3e"}
KIND_COLORS = (COLORS["text"], COLORS["image"], COLORS["video"])
COST_PLOT_RANKS = 8


def sample_lengths(figures: pa.Table) -> np.ndarray:
    """Every packed sample's length, bin by bin, from the bins' cu_seqlens."""
    cu = figures.column("cu_seqlens").combine_chunks()
    values = cu.flatten().to_numpy().astype(np.int64)
    lengths = np.diff(values)
    starts = cu.offsets.to_numpy()[1:-1] - 1  # the diff across a bin boundary is not a length
    return np.delete(lengths, starts) if len(starts) else lengths


def sample_kinds(figures: pa.Table) -> np.ndarray:
    """Per packed sample (in ``sample_lengths`` order): 0 text only, 1 with images, 2 with video."""
    samples = figures.column("num_samples").to_numpy().astype(np.int64)
    first = np.concatenate(([0], np.cumsum(samples)[:-1]))
    kinds = np.zeros(int(samples.sum()), np.int8)
    media = figures.column("media").combine_chunks()
    per_bin = np.diff(media.offsets.to_numpy())
    if not per_bin.sum():
        return kinds
    items = media.flatten()
    index = np.repeat(first, per_bin) + items.field("sample_index").to_numpy().astype(np.int64)
    video = pc.equal(items.field("kind"), "video").to_numpy(zero_copy_only=False)
    kind = np.where(video, 2, 1).astype(np.int8)
    np.maximum.at(kinds, index, kind)
    return kinds


def lengths_plot(figures: pa.Table, budget: int, over: Mapping[str, Any]) -> bytes:
    """Sample lengths stacked by modality, the budget marked, and what did not fit as it was."""

    def draw(axes: Any) -> None:
        lengths, kinds = sample_lengths(figures), sample_kinds(figures)
        edges = np.linspace(0, max(budget, int(lengths.max(initial=1))), 51)
        groups = [lengths[kinds == k] for k in range(3)]
        axes.hist(groups, bins=edges, stacked=True, color=KIND_COLORS, label=list(MODALITIES))
        axes.axvline(budget, color=COLORS["budget"], linestyle="--", label=f"budget {budget:,}")
        axes.set(xlabel="sample length (tokens)", ylabel="samples")
        axes.set_title(f"Sample lengths, {len(lengths):,} packed samples")
        axes.legend()
        note = over_length_note(over)
        axes.text(0.99, 0.6, note, transform=axes.transAxes, ha="right", va="top", fontsize=8)

    return _png(draw)


def over_length_note(over: Mapping[str, Any]) -> str:
    """One line per way a sample did not fit: dropped, truncated or split, skipped by pack."""
    lines = []
    if over.get("dropped"):
        lines.append(f"{over['dropped']:,} dropped (too_long > {over['max_tokens']:,})")
    if over.get("over_length"):
        lines.append(f"{over['over_length']:,} over {over['max_tokens']:,}: {over['policy']}")
    if over.get("skipped"):
        lines.append(f"{over['skipped']:,} skipped by pack (over a budget)")
    return "\n".join(lines) or "nothing dropped, truncated, split or skipped"


def tokens_plot(figures: pa.Table, budget: int) -> bytes:
    """Tokens per bin stacked by modality, bins from fullest to emptiest, the budget marked."""

    def draw(axes: Any) -> None:
        image = figures.column("image_tokens").to_numpy().astype(np.int64)
        video = figures.column("video_tokens").to_numpy().astype(np.int64)
        text = figures.column("num_tokens").to_numpy().astype(np.int64) - image - video
        order = np.argsort(-(text + image + video), kind="stable")
        order = np.append(order, order[-1:])  # the last step drawn to its right edge
        x = np.arange(len(order))
        layers = [text[order], image[order], video[order]]
        axes.stackplot(x, *layers, colors=KIND_COLORS, labels=["text", "image", "video"], step="post")
        axes.axhline(budget, color=COLORS["budget"], linestyle="--", label=f"budget {budget:,}")
        axes.set(xlabel="bins, fullest first", ylabel="tokens", title=f"Tokens per bin, {len(x) - 1:,} bins")
        axes.legend(loc="lower left")

    return _png(draw)


def sorted_plot(values: np.ndarray, title: str, ylabel: str, limit: tuple[float, str] | None = None) -> bytes:
    """One per-bin figure, bins sorted from largest to smallest, its mean (and a limit) marked."""

    def draw(axes: Any) -> None:
        ordered = np.sort(values.astype(np.float64))[::-1]
        axes.plot(ordered, color=COLORS["text"], drawstyle="steps-post")
        if len(ordered):
            axes.axhline(ordered.mean(), color="#777777", linestyle=":", label=f"mean {ordered.mean():,.0f}")
        if limit is not None:
            axes.axhline(limit[0], color=COLORS["budget"], linestyle="--", label=limit[1])
        axes.set(xlabel="bins, largest first", ylabel=ylabel, title=title)
        axes.legend()

    return _png(draw)


def bin_plots(figures: pa.Table, manifest: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, bytes]:
    """Every figure-based plot of the report, by file name."""
    budget = manifest["budget"]
    second = manifest["config"]["pack"]
    patches_limit = None
    if second.get("second_budget_by") == "vision_patches" and second.get("second_budget"):
        patches_limit = (second["second_budget"], f"second budget {second['second_budget']:,}")

    def per_bin(name: str) -> np.ndarray:
        return figures.column(name).to_numpy()

    attention = "Attention cost per bin (sum of squared sample lengths)"
    return {
        LENGTHS_PLOT: lengths_plot(figures, budget, over),
        TOKENS_PLOT: tokens_plot(figures, budget),
        SUPERVISED_PLOT: sorted_plot(per_bin("supervised_tokens"), "Supervised tokens per bin", "tokens"),
        ATTENTION_PLOT: sorted_plot(per_bin("sum_sq_lengths"), attention, "Σ l²"),
        PATCHES_PLOT: sorted_plot(
            per_bin("vision_patches"), "Vision patches per bin", "patches (before merging)", patches_limit
        ),
    }


def cost_plot(index: pa.Table, manifest: Mapping[str, Any]) -> bytes:
    """Per-bin cost per phase, sorted; and per step of an 8-rank epoch, the slowest rank's
    cost over the mean rank's, in today's order and in the balanced plan."""
    from loader import balance, plan

    model = costs.CostModel.for_profile(manifest["config"], manifest["profile"])
    vision, llm = model.phases(index)
    sizes = np.array([u.rows for u in plan.units_of(manifest["shards"], manifest["bins_per_row_group"])])
    plans = {
        "today's order": balance.random_plan(sizes, COST_PLOT_RANKS, 0, 0),
        "balanced": balance.balanced_plan(vision, llm, sizes, COST_PLOT_RANKS, 0, 0),
    }

    def draw(axes: Any) -> None:
        left, right = axes
        for values, label in ((vision, "vision"), (llm, "LLM")):
            if values.any():
                left.plot(np.sort(values)[::-1] / values.mean(), label=label)
        left.set(xlabel="bins, most expensive first", ylabel="cost / mean bin cost", title="Per-bin cost")
        left.legend()
        step = vision + llm
        for label, chosen in plans.items():
            costs_per_rank = step[chosen.bins]
            slowest = costs_per_rank.max(axis=1) / costs_per_rank.mean(axis=1)
            right.plot(slowest, label=f"{label}: +{balance.straggler_overhead(step, chosen, 1):.1%} overall")
        right.set(xlabel="step (1 bin per rank)", ylabel="slowest rank / mean rank",
                  title=f"Per-rank cost, {COST_PLOT_RANKS} ranks")  # fmt: skip
        right.legend()

    return _png(draw, size=(11, 4), panels=2)


def _png(draw: Callable[[Any], None], size: tuple[float, float] = (7, 4), panels: int = 1) -> bytes:
    """Run ``draw(axes)`` on a new figure of ``panels`` side by side and return it as PNG
    bytes (no timestamp: stable)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, panels, figsize=size, dpi=100)
    try:
        draw(axes)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", metadata={"Software": None})
        return buffer.getvalue()
    finally:
        plt.close(figure)
