"""What the session says when training stops making progress: which rank, where it was, what its process is doing.
Pure, except :func:`local_process_states`, which reads the ranks' processes on this machine."""
from __future__ import annotations

import socket
from typing import Iterable, Iterator, Mapping

import psutil

STATES = {psutil.STATUS_STOPPED: "stopped (SIGSTOP?)", psutil.STATUS_DISK_SLEEP: "in uninterruptible I/O",
          psutil.STATUS_ZOMBIE: "exited", psutil.STATUS_TRACING_STOP: "stopped by a tracer"}


def _local_processes(world: Iterable[Mapping]) -> Iterator[tuple[int, psutil.Process | None]]:
    """(rank, its engine process, or None if gone) for the ranks whose engine runs on this machine."""
    here = socket.gethostname()
    for w in world:
        if w.get("host") != here or not w.get("pid"):
            continue
        try:
            process = psutil.Process(int(w["pid"]))
        except psutil.NoSuchProcess:
            process = None
        except psutil.Error:
            continue
        yield int(w["rank"]), process


def local_process_states(world: Iterable[Mapping]) -> dict[int, str]:
    """rank → what its process is doing, for the ranks whose engine runs on this machine."""
    states = {}
    for rank, p in _local_processes(world):
        try:
            status = p.status() if p is not None else None
            states[rank] = "gone" if status is None else STATES.get(status, status)
        except psutil.NoSuchProcess:
            states[rank] = "gone"
        except psutil.Error:
            pass
    return states


def kill_local_engines(world: Iterable[Mapping]) -> None:
    """SIGKILL this machine's engine processes of ``world`` (a stopped process takes no other signal)."""
    me = psutil.Process().uids().real
    for _, p in _local_processes(world):
        try:
            if p is not None and p.uids().real == me:
                p.kill()
        except psutil.Error:
            pass


def suspects(world: Iterable[Mapping], latest: Mapping[int, Mapping], states: Mapping[int, str]) -> list[int]:
    """Ranks most likely to hold the others up: those whose process is not running normally, else those whose
    last reported batch is behind the rest."""
    ranks = sorted(int(w["rank"]) for w in world)
    odd = [r for r in ranks if states.get(r) not in (None, "running", "sleeping")]
    if odd:
        return odd
    progress = {r: (latest.get(r, {}).get("epoch") or 0, latest.get(r, {}).get("batch") or -1) for r in ranks}
    if not progress or len(set(progress.values())) <= 1:
        return []
    lowest = min(progress.values())
    return [r for r, p in progress.items() if p == lowest]


def stall_message(what: str, seconds: float, setting: str, world: Iterable[Mapping], latest: Mapping[int, Mapping],
                  states: Mapping[int, str]) -> str:
    world = list(world)
    parts = []
    for w in sorted(world, key=lambda w: int(w["rank"])):
        r = int(w["rank"])
        row = latest.get(r)
        where = f"last at epoch {row.get('epoch')} batch {row.get('batch')}" if row else "no batch reported yet"
        parts.append(f"rank {r} ({w.get('node') or w.get('host', '?')}): {where}"
                     + (f", process {states[r]}" if r in states else ""))
    held = suspects(world, latest, states)
    blame = f"rank(s) {', '.join(map(str, held))} held the others up. " if held else ""
    first = ""
    if world and not held and not any(latest.get(int(w["rank"])) for w in world):
        first = (" No rank finished a first batch: if that is its tracing or compilation (a large model, more ranks "
                 "than cores), give the first batch more time (TrainingSession(stall_timeout=...) for a fit, "
                 "run_script(first_batch_timeout=...) for a script).")
    return (f"{what} made no progress for {seconds:.0f} s ({setting}): {blame}{'; '.join(parts)}. The world was "
            f"ended: recover(checkpoint) starts a new one from the last checkpoint.{first}")
