"""bqplot charts that update in place: one line per rank, and the scaling plot against the ideal line."""
from __future__ import annotations

import bqplot as bq
from ipywidgets import Layout

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf"]


def figure(title: str, xlabel: str, ylabel: str, width: str = "32%") -> bq.Figure:
    x, y = bq.LinearScale(), bq.LinearScale()
    axes = [bq.Axis(scale=x, label=xlabel), bq.Axis(scale=y, side="left", label=ylabel, tick_format=".3~s")]
    fig = bq.Figure(marks=[], axes=axes, title=title, legend_location="top-right", animation_duration=0,
                    fig_margin={"top": 40, "bottom": 40, "left": 55, "right": 10},
                    layout=Layout(width=width, min_width="260px", height="260px"))
    fig.scales_ = (x, y)  # kept for the marks added later
    return fig


def set_rank_lines(fig: bq.Figure, series: dict[str, tuple[list, list]]) -> None:
    """A line per label of ``series`` (a rank's, or the spread over many ranks: ``series.chart_series``), added
    when it first appears and removed when it is gone; data replaced in place."""
    x, y = fig.scales_
    lines = {m.labels[0]: m for m in fig.marks}
    new = []
    for i, (label, (steps, values)) in enumerate(series.items()):
        line = lines.get(label)
        if line is None:
            number = label.split()[-1]
            color = COLORS[(int(number) if label.startswith("rank ") and number.isdigit() else i) % len(COLORS)]
            line = bq.Lines(x=steps, y=values, scales={"x": x, "y": y}, labels=[label], display_legend=True,
                            colors=[color], stroke_width=1.5)
            new.append(line)
        else:
            with line.hold_sync():
                line.x, line.y = steps, values
    if new or set(lines) - set(series):
        fig.marks = [m for label, m in lines.items() if label in series] + new


def clear(fig: bq.Figure) -> None:
    fig.marks = []


def scaling_figure() -> tuple[bq.Figure, bq.Lines, bq.Lines, bq.Lines]:
    """Speedup (measured, ideal) and efficiency against the rank count."""
    x, y = bq.LinearScale(), bq.LinearScale(min=0)
    measured = bq.Lines(x=[], y=[], scales={"x": x, "y": y}, marker="circle", labels=["speedup"], display_legend=True,
                        colors=[COLORS[0]])
    ideal = bq.Lines(x=[], y=[], scales={"x": x, "y": y}, line_style="dashed", labels=["ideal"], display_legend=True,
                     colors=["#888888"])
    efficiency = bq.Lines(x=[], y=[], scales={"x": x, "y": y}, marker="square", labels=["efficiency"],
                          display_legend=True, colors=[COLORS[2]])
    axes = [bq.Axis(scale=x, label="ranks", tick_format="d"), bq.Axis(scale=y, side="left",
                                                                      label="speedup / efficiency")]
    fig = bq.Figure(marks=[ideal, measured, efficiency], axes=axes, title="scaling", legend_location="top-left",
                    animation_duration=0, layout=Layout(width="480px", height="320px"))
    return fig, measured, ideal, efficiency


def set_scaling(fig: bq.Figure, measured: bq.Lines, ideal: bq.Lines, efficiency: bq.Lines, table) -> None:
    ranks = [float(r) for r in table["ranks"]]
    fig.axes[0].tick_values = ranks  # a tick at each rank count measured
    for line, column in ((measured, "speedup"), (ideal, "ideal"), (efficiency, "efficiency")):
        with line.hold_sync():
            line.x, line.y = ranks, [float(v) for v in table[column]]
