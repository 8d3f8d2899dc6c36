"""The live training dashboard: controls, one chart per metric with a line per rank, the epoch's progress, the rank
table and errors in place. Training runs in a background thread, so the kernel stays free for the buttons (Stop)
and the charts update while it runs."""
from __future__ import annotations

import math
import os
import threading
import time

import ipywidgets as w

from ..training.session import TrainingSession
from . import charts
from .series import CHARTS, GPU_CHARTS, chart_series, epoch_progress, error_html, rank_table_html


class Dashboard(w.VBox):
    """``Dashboard()`` trains the package's digits example. For your own problem pass ``model_fn`` and ``data_fn``
    as for :meth:`TrainingSession.setup` — a model you compile yourself (then the learning-rate box is off: your
    optimizer sets it), or ``loss`` for the short form — with any other ``setup`` options in ``setup_options``
    (``validation_data``, ``callbacks``, ``seed`` …); or a ``session`` you started and set up yourself (a running
    ``run_script`` shows here too)."""

    def __init__(self, session: TrainingSession | None = None, model_fn=None, data_fn=None, loss=None, metrics=(),
                 ranks: int | None = None, epochs: int = 2, batch_size: int = 32, lr: float = 0.05, max_ranks: int = 64,
                 checkpoint_dir: str = "~/hpcdl-checkpoints", refresh: float = 0.3, setup_options: dict | None = None,
                 **session_options):
        if model_fn is None and (session is None or not session.has_model):
            from ..training import examples

            model_fn, data_fn, loss = examples.digits_model, examples.digits_shard, loss or examples.digits_loss
        if model_fn is not None and data_fn is None:
            raise ValueError("give data_fn (the data: arrays, a function (rank, size), or a .npz path) with model_fn")
        self.session = session
        self.problem = (model_fn, data_fn, loss, tuple(metrics))
        self.setup_options = dict(setup_options or {})
        self.session_options = session_options
        self.checkpoint_dir = os.path.expanduser(checkpoint_dir)
        self.last_checkpoint: str | None = None
        self.refresh = refresh
        self.per_epoch = 1
        self.fit_range = (1, epochs)  # the running fit: its first epoch, and how many
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        self.busy_widgets: list[w.DOMWidget] = []  # disabled while an action runs (e.g. the scaling tab's button)
        self._drawn_at = 0.0

        style = {"description_width": "initial"}
        if session is not None and session.ranks:
            ranks = session.ranks
        elif ranks is None:  # as the session would: one per slot of the kernel's job, two elsewhere
            from ..training.placement import default_ranks, resolve

            ranks = default_ranks(resolve(session_options.get("where", "auto")))
        self.ranks = w.BoundedIntText(value=min(ranks, max_ranks), min=1, max=max_ranks,
                                      description="ranks", style=style, layout=w.Layout(width="120px"))
        self.epochs = w.BoundedIntText(value=epochs, min=1, max=10_000, description="epochs", style=style,
                                       layout=w.Layout(width="120px"))
        self.batch_size = w.BoundedIntText(value=batch_size, min=1, max=1 << 20, description="batch size",
                                           style=style, layout=w.Layout(width="150px"))
        self.lr = w.BoundedFloatText(value=lr, min=1e-8, max=10.0, step=0.01, description="learning rate",
                                     style=style, layout=w.Layout(width="170px"))
        self.buttons = {name: w.Button(description=name, icon=icon, tooltip=tip, layout=w.Layout(width="auto"))
                        for name, icon, tip in (
                            ("Train", "play", "start the ranks if needed, then train the given epochs"),
                            ("Stop", "stop", "all ranks stop after the same batch"),
                            ("Checkpoint", "save", "write the model's state (atomically)"),
                            ("Resume", "undo", "load the last checkpoint (in a new world if a rank died)"),
                            ("Rescale", "arrows-h", "continue with the number of ranks above"),
                            ("Close", "power-off", "stop the ranks"))}
        for name, button in self.buttons.items():
            button.on_click(lambda _b, name=name: self._on_button(name))
        self.buttons["Train"].button_style = "success"
        self.buttons["Stop"].button_style = "warning"
        self.status = w.HTML(self._status_text("no ranks yet"))
        self.progress = w.IntProgress(value=0, min=0, max=1, description="epoch 0/0", style=style,
                                      layout=w.Layout(width="60%"))
        self.figures = {column: charts.figure(title, "step", title)
                        for column, title in {**CHARTS, **GPU_CHARTS}.items()}
        for column in GPU_CHARTS:
            self.figures[column].layout.display = "none"  # until ranks with GPUs are there
        self.table = w.HTML(rank_table_html([]))
        self.error = w.HTML("")
        controls = w.HBox([self.ranks, self.epochs, self.batch_size, self.lr], layout=w.Layout(flex_flow="row wrap"))
        super().__init__([controls, w.HBox(list(self.buttons.values())), w.HBox([self.progress, self.status]),
                          w.HBox(list(self.figures.values()), layout=w.Layout(flex_flow="row wrap")),
                          self.table, self.error])
        self.add_class("hpcdl-dashboard")
        self._set_busy(False)
        if session is not None and session.alive and session.has_model:
            self.measure_epoch()
            self.draw(force=True)

    # -- actions (each in the background thread) --------------------------------------------------------------------
    def train(self) -> None:
        s = self.ensure_session()
        if self.ranks.value != s.ranks:
            self.say(f"rescaling to {self.ranks.value} ranks")
            s.rescale(self.ranks.value)
            self.measure_epoch()
        if not s.user_optimizer:  # the user's own optimizer follows its own rate
            taken = s.set_lr(self.lr.value)
            if not all(math.isclose(lr, self.lr.value, rel_tol=1e-6) for lr in taken):
                raise RuntimeError(f"the ranks did not take the learning rate {self.lr.value}: they have {taken}")
        self.fit_range = (s.epochs_done + 1, self.epochs.value)
        self.say(f"training {self.epochs.value} epoch(s) on {s.ranks} ranks")
        result = s.fit(epochs=self.epochs.value, on_metrics=lambda _t: self.draw())
        self.draw(force=True, finished=True)
        self.say(f"{result.stopped}" if result.stopped else
                 f"done: {result.epochs_done} epochs, loss {result.loss[-1]:.4g}, {result.seconds:.1f} s")

    def ensure_session(self) -> TrainingSession:
        """The session with its ranks up and the model built: started and set up here the first time (and after
        Close)."""
        if self.session is not None and self.session.has_model and not self.session.world:
            raise RuntimeError("the ranks are gone (a rank died): press Resume to continue from the last "
                               "checkpoint, or Close and then Train to start afresh")
        if self.session is None or not self.session.world:
            if self.session is None:
                self.session = TrainingSession(ranks=self.ranks.value, **self.session_options)
            self.session.ranks = self.ranks.value
            self.say(f"starting {self.ranks.value} ranks")
            self.session.start()
            self.draw(force=True)
        if not self.session.has_model:
            self.say("building the model on every rank")
            model_fn, data_fn, loss, metrics = self.problem
            if model_fn is None:
                raise RuntimeError("this dashboard was given a session without a model: press Close, or give "
                                   "model_fn and data_fn")
            if loss is None:  # the user's compiled model
                self.session.setup(model_fn, data_fn, batch_size=self.batch_size.value, **self.setup_options)
            else:
                self.session.setup(model_fn, data_fn, loss, metrics, lr=self.lr.value,
                                   batch_size=self.batch_size.value, **self.setup_options)
            self.measure_epoch()
        return self.session

    def measure_epoch(self) -> None:
        """Batches per epoch (of the largest shard) for the progress bar and the charts' step axis."""
        s = self.session
        self.per_epoch = s.batches_per_epoch or 1
        self.batch_size.value, self.batch_size.disabled = s.batch_size, True  # fixed once the model is built
        if s.user_optimizer:
            self.lr.disabled = True
            self.lr.description = "learning rate (your optimizer's)"

    def checkpoint(self) -> None:
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        self.last_checkpoint = self._require_session().checkpoint(os.path.join(self.checkpoint_dir, "latest"))
        self.say(f"checkpoint written: {self.last_checkpoint}")

    def resume(self) -> None:
        s = self._require_session()
        path = self.last_checkpoint or os.path.join(self.checkpoint_dir, "latest")
        if not os.path.exists(path):
            raise RuntimeError(f"no checkpoint at {path}: press Checkpoint first")
        if s.alive:
            s.resume(path)
        else:
            self.say(f"starting a new world of {self.ranks.value} ranks from {path}")
            s.recover(path, self.ranks.value)
        self.measure_epoch()
        self.draw(force=True)
        self.say(f"resumed from {path}")

    def rescale(self) -> None:
        self._require_session().rescale(self.ranks.value)
        self.measure_epoch()
        self.draw(force=True)
        self.say(f"now {self.ranks.value} ranks")

    def stop_ranks(self) -> None:
        """Stop the ranks (the widget stays)."""
        if self.session is not None:
            self.session.close()
        self.draw(force=True)
        self.say("ranks stopped")

    def _require_session(self) -> TrainingSession:
        if self.session is None or not self.session.has_model:
            raise RuntimeError("no model yet: press Train first")
        return self.session

    # -- plumbing ----------------------------------------------------------------------------------------------------
    def _on_button(self, name: str) -> None:
        if name == "Stop":
            if self.session is not None:
                self.session.stop_training()
                self.say("stopping after the current batch …")
            return
        action = {"Train": self.train, "Checkpoint": self.checkpoint, "Resume": self.resume,
                  "Rescale": self.rescale, "Close": self.stop_ranks}[name]
        self.run_in_background(action, self.error, name)

    def run_in_background(self, action, error: w.HTML, name: str = "action") -> bool:
        """Run ``action`` in the dashboard's one worker thread (one action at a time on the session, from either
        tab); its error is shown in ``error``. False when another action is still running."""
        with self._lock:
            if self._worker is not None and self._worker.is_alive():
                return False
            error.value = ""
            self._set_busy(True)
            self._worker = threading.Thread(target=self._run, args=(action, error), name=f"hpcdl-dashboard-{name}",
                                            daemon=True)
            self._worker.start()
        return True

    def _run(self, action, error: w.HTML) -> None:
        try:
            action()
        except Exception as e:  # shown in place, with the rank named when a rank failed
            error.value = error_html(f"{type(e).__name__}: {e}")
            self.say("failed")
            self.draw(force=True)
        finally:
            self._set_busy(False)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the current action ends (for scripts and tests)."""
        if self._worker is not None:
            self._worker.join(timeout)

    def _set_busy(self, busy: bool) -> None:
        for name, button in self.buttons.items():
            button.disabled = busy if name != "Stop" else not busy
        for widget in (self.ranks, *self.busy_widgets):
            widget.disabled = busy

    def say(self, text: str) -> None:
        """Show ``text`` in the status line."""
        self.status.value = self._status_text(text)

    @staticmethod
    def _status_text(text: str) -> str:
        import html

        return f'<span class="hpcdl-status">{html.escape(text)}</span>'

    def draw(self, force: bool = False, finished: bool = False) -> None:
        """Redraw charts, progress and rank table from the session's metrics (at most every ``refresh`` s)."""
        now = time.monotonic()
        if (not force and now - self._drawn_at < self.refresh) or self.session is None:
            return
        self._drawn_at = now
        s = self.session
        frame = s.metrics
        if s.world:  # the ranks of this world only (a rescale may have had more)
            frame = frame[frame["rank"].isin([r["rank"] for r in s.world])]
        for column in GPU_CHARTS:
            self.figures[column].layout.display = None if any(w.get("gpus") for w in s.world) else "none"
        for column, fig in self.figures.items():
            charts.set_rank_lines(fig, chart_series(frame, column, self.per_epoch))
        first, epochs = self.fit_range
        done, total, label = epoch_progress(s.metrics_table.latest(), self.per_epoch, first, epochs)
        with self.progress.hold_sync():
            self.progress.max, self.progress.value = total, total if finished else done
            self.progress.description = f"epoch {epochs}/{epochs}" if finished else label
        self.table.value = rank_table_html(s.rank_table() if s.world else [])
