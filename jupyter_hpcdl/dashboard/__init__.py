"""The notebook dashboard (ipywidgets 8 + bqplot): live per-rank training and scaling experiments.

    from jupyter_hpcdl.dashboard import Dashboard
    Dashboard()                      # the digits example; or Dashboard(model_fn=..., data_fn=..., loss=...)"""
from __future__ import annotations

import ipywidgets as w

from .scaling import ScalingPanel
from .training import Dashboard as TrainingDashboard

__all__ = ["Dashboard", "TrainingDashboard", "ScalingPanel"]


def Dashboard(*args, **kwargs) -> w.Tab:  # noqa: N802 - reads as the widget it returns
    """Training and scaling tabs over one session; the parts are ``.training`` and ``.scaling``."""
    training = TrainingDashboard(*args, **kwargs)
    scaling = ScalingPanel(training, max_ranks=training.ranks.max)
    tabs = w.Tab(children=[training, scaling], titles=("Training", "Scaling"))
    tabs.training, tabs.scaling = training, scaling
    tabs.add_class("hpcdl-dashboard-tabs")
    return tabs
