"""An existing ``torchrun`` script, run unchanged on the session's ranks (runs on the ranks): as ``python script.py
args`` would, in this rank's world. Its ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set;
its ``init_process_group()`` joins the world the rank is already in and its ``destroy_process_group()`` leaves it to
the session. After every optimizer step the session publishes the step's time (and the figures the script gives
``jupyter_hpcdl.report``) and, every few steps, checks Stop with the other ranks (a ``Join`` for uneven inputs
takes that check too)."""
from __future__ import annotations

import contextlib
import inspect
import threading
import time

from ...figures import reported
from ..scriptrun import run_main
from ..steps import StepWatch
from . import dist
from .rank_steps import step_watch


@contextlib.contextmanager
def joined_world():
    """While a script runs in a rank that joined its world: the script's ``init_process_group()`` is that world
    (a no-op) and its ``destroy_process_group()`` leaves it to the rank (the session's, or the launcher's)."""
    import torch.distributed as torch_dist

    original_init, original_destroy = torch_dist.init_process_group, torch_dist.destroy_process_group

    def init_process_group(*args, **kwargs):
        if not torch_dist.is_initialized():
            return original_init(*args, **kwargs)
        return None  # the rank is in its world already

    def destroy_process_group(group=None):
        if group is not None:
            return original_destroy(group)
        return None  # the world outlives the script

    torch_dist.init_process_group, torch_dist.destroy_process_group = init_process_group, destroy_process_group
    try:
        yield
    finally:
        torch_dist.init_process_group, torch_dist.destroy_process_group = original_init, original_destroy


@contextlib.contextmanager
def stop_check_in_joins(watch: StepWatch, progress: dict):
    """While a script runs: each ``Join`` it makes for uneven inputs (DDP's ``torch.distributed.algorithms.join``)
    also takes the session's Stop check as its last joinable. A rank whose inputs ran out shadows the others'
    collectives for each iteration they still take, the Stop check's among them (unless a joinable's own hook
    stepped an optimizer, as ``ZeroRedundancyOptimizer``'s does, which made the check), and leaves with them when
    they agree to stop. It assumes one optimizer step per forward, as DDP's ``Join`` counts forwards."""
    from torch.distributed.algorithms.join import Join, Joinable, JoinHook

    class StopCheckShadow(JoinHook):
        def main_hook(self) -> None:
            if progress["stepped"]:  # an earlier hook of this iteration stepped (and checked) as the others did
                progress["stepped"] = False
                return
            batch = progress["index"]  # the step the others are taking
            progress["index"] += 1
            watch.check_stop(0, batch)

    class StopCheck(Joinable):
        def __init__(self, first: Joinable):
            super().__init__()
            self.first = first

        def join_hook(self, **kwargs) -> JoinHook:
            return StopCheckShadow()

        @property
        def join_device(self):
            return self.first.join_device

        @property
        def join_process_group(self):
            return self.first.join_process_group

    original_init, original_exit = Join.__init__, Join.__exit__

    def __init__(self, joinables, *args, **kwargs):
        joinables = list(joinables)
        if joinables:
            joinables.append(StopCheck(joinables[0]))
        original_init(self, joinables, *args, **kwargs)

    def __exit__(self, *exc):
        progress["stepped"] = False  # this rank's own steps are over: from here on only hooks step
        return original_exit(self, *exc)

    Join.__init__, Join.__exit__ = __init__, __exit__
    try:
        yield
    finally:
        Join.__init__, Join.__exit__ = original_init, original_exit


def _under_way(frame, stepping: list) -> list:
    """The entries of ``stepping`` (frames of optimizer steps under way, outermost first) that ``frame`` runs
    inside: a step that raised (its post hook never ran) is over once its frame is no longer on the call stack."""
    chain = set()
    while frame is not None:
        chain.add(id(frame))
        frame = frame.f_back
    return [entry for entry in stepping if id(entry) in chain]


@contextlib.contextmanager
def session_steps(stop_file: str, publish_every: int, check_every: int, min_interval: float):
    """While the script runs: its process group calls meet the session's world (:func:`joined_world`), and each
    optimizer step is watched (:class:`jupyter_hpcdl.backends.steps.StepWatch`). ``steps`` counts this rank's
    optimizer steps, ``index`` the world's (the same on every rank: a rank whose inputs ran out in a ``Join`` counts
    the steps it shadows). A step taken inside another (``ZeroRedundancyOptimizer``'s local optimizer, a subclass's
    ``step`` calling ``super().step()``) is part of the outer one, not one of its own."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    watch = step_watch(stop_file, publish_every, check_every, min_interval)
    progress = {"steps": 0, "index": 0, "stepped": False, "last": time.perf_counter()}
    # The steps under way in each thread, each as the frame of PyTorch's step wrapper that calls the global hooks
    # (the hooks' caller), outermost first: a step is known by its call, not by its optimizer, which may step inside
    # its own step.
    stacks: dict[int, list] = {}

    def before_step(optimizer, args, kwargs):
        caller = inspect.currentframe().f_back
        stepping = stacks.setdefault(threading.get_ident(), [])
        if stepping:
            stepping[:] = _under_way(caller, stepping)
        stepping.append(caller)

    def after_step(optimizer, args, kwargs):
        caller = inspect.currentframe().f_back
        stepping = stacks.setdefault(threading.get_ident(), [])
        for i in range(len(stepping) - 1, -1, -1):
            if stepping[i] is caller:  # those inside it that raised, while it went on, are over too
                del stepping[i:]
                break
        else:  # not called from the frame that called the pre hook (not so in PyTorch 2.x): the innermost ends
            del stepping[-1:]
        if stepping:
            return
        figures = reported()
        loss = figures.pop("loss", None)
        batch = progress["index"]
        started, progress["last"] = progress["last"], time.perf_counter()
        progress["steps"] += 1
        progress["index"] += 1
        progress["stepped"] = True
        watch.step(0, batch, started, None, loss, figures)

    handles = [register_optimizer_step_pre_hook(before_step), register_optimizer_step_post_hook(after_step)]
    try:
        with joined_world(), stop_check_in_joins(watch, progress):
            yield progress
    finally:
        for handle in handles:
            handle.remove()
        stacks.clear()  # a step that raised last holds its frames


def run_script(path: str, args: list[str], stop_file: str, publish_every: int = 5, check_every: int = 20,
               min_interval: float = 0.0) -> dict:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *args]``; this rank's exit code, whether Stop ended it,
    and the optimizer steps it took."""
    with session_steps(stop_file, publish_every, check_every, min_interval) as progress:
        end = run_main(path, args)
    return {"rank": dist.rank(), "exit_code": end.exit_code, "stopped": end.stopped, "epochs_done": 0,
            "steps": progress["steps"]}
