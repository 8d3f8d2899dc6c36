"""The scaling experiment: choose rank counts and strong or weak scaling, watch it run, see speedup and efficiency
against the ideal line and the table, export CSV and PNG."""
from __future__ import annotations

import html
import os

import ipywidgets as w

from ..training.experiments import plot_scaling
from . import charts
from .series import error_html, parse_rank_counts


class ScalingPanel(w.VBox):
    """Runs :meth:`TrainingSession.scaling` on the dashboard's session (started and set up by it if needed)."""

    def __init__(self, dashboard, counts: str = "1, 2", max_ranks: int = 64, export_dir: str = "~/hpcdl-scaling"):
        self.dashboard = dashboard
        self.max_ranks = max_ranks
        self.export_dir = os.path.expanduser(export_dir)
        self.table_frame = None
        style = {"description_width": "initial"}
        self.counts = w.Text(value=counts, description="rank counts", style=style, layout=w.Layout(width="220px"))
        self.mode = w.ToggleButtons(options=["strong", "weak"], value="strong", style={"button_width": "64px"},
                                    layout=w.Layout(width="auto"))
        self.epochs = w.BoundedIntText(value=2, min=1, max=1000, description="epochs per count", style=style,
                                       layout=w.Layout(width="170px"))
        self.run_button = w.Button(description="Run scaling", icon="line-chart", button_style="primary")
        self.export_button = w.Button(description="Export CSV + PNG", icon="download", disabled=True,
                                      layout=w.Layout(width="auto"))
        self.run_button.on_click(lambda _b: self._start())
        self.export_button.on_click(lambda _b: self._export())
        self.progress = w.IntProgress(value=0, min=0, max=1, description="0/0 counts", style=style)
        self.figure, self.measured, self.ideal, self.efficiency = charts.scaling_figure()
        self.table = w.HTML("")
        self.exported = w.HTML("")
        self.error = w.HTML("")
        controls = w.HBox([self.counts, self.mode, self.epochs, self.run_button, self.export_button],
                          layout=w.Layout(flex_flow="row wrap", align_items="center"))
        super().__init__([controls,
                          self.progress, w.HBox([self.figure, self.table]), self.exported, self.error])
        self.add_class("hpcdl-scaling")
        dashboard.busy_widgets += [self.run_button, self.counts, self.mode, self.epochs]

    def run(self) -> None:
        counts = parse_rank_counts(self.counts.value, self.max_ranks)
        d = self.dashboard
        session = d.ensure_session()
        rows = []
        self.progress.max, self.progress.value, self.progress.description = len(counts), 0, f"0/{len(counts)} counts"

        def step(row: dict) -> None:
            rows.append(row)
            self.progress.value, self.progress.description = len(rows), f"{len(rows)}/{len(counts)} counts"
            d.say(f"scaling: {row['ranks']} ranks, {row['throughput']:.0f} samples/s")

        d.fit_range = (1, 1 + self.epochs.value)  # each count: a warm-up epoch and the measured ones
        table = session.scaling(counts, epochs=self.epochs.value, mode=self.mode.value, on_step=step,
                                on_metrics=lambda _t: d.draw())
        self.table_frame = table
        charts.set_scaling(self.figure, self.measured, self.ideal, self.efficiency, table)
        self.table.value = table.to_html(index=False, float_format=lambda v: f"{v:.3g}", classes="hpcdl-scaling-table")
        d.ranks.value = session.ranks
        d.measure_epoch()
        d.draw(force=True)
        d.say(f"scaling done ({self.mode.value}); the model is back as it was, on {session.ranks} ranks")
        self.export_button.disabled = False

    def export(self) -> tuple[str, str]:
        """Write the table as CSV and the plot as PNG into ``export_dir``; return both paths."""
        if self.table_frame is None:
            raise RuntimeError("run a scaling experiment first")
        os.makedirs(self.export_dir, exist_ok=True)
        stem = os.path.join(self.export_dir, f"scaling-{self.table_frame['mode'].iloc[0]}")
        csv, png = stem + ".csv", stem + ".png"
        self.table_frame.to_csv(csv, index=False)
        plot_scaling(self.table_frame, png)
        self.exported.value = f'<span class="hpcdl-exported">wrote {html.escape(csv)} and {html.escape(png)}</span>'
        return csv, png

    def wait(self, timeout: float | None = None) -> None:
        self.dashboard.wait(timeout)

    def _start(self) -> None:
        self.dashboard.run_in_background(self.run, self.error, "scaling")

    def _export(self) -> None:
        self.error.value = ""
        try:
            self.export()
        except Exception as e:
            self.error.value = error_html(f"{type(e).__name__}: {e}")
