"""A training session's ranks (runs in the kernel): one world at a time, started on a placement's engines
(:mod:`.placement`) and joined over Gloo, with the session's own rendezvous, or MPI (:mod:`.joining`); calls on
every rank with a deadline and errors that name the rank, the ranks that died, and an end that leaves nothing
running (a reaper ends the rest if the kernel dies first)."""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Callable

import ipyparallel as ipp

from ..job.owner import owner_socket
from ..backends import Backend
from .joining import check_one_world, gloo_envs, mpi_envs
from .placement import LocalPlacement, Placement, PlacementOptions
from .placement_allocation import AllocationPlacement
from .placement_new import NewAllocationPlacement
from .reaper import start_reaper, stop_reaper
from .results import RankError
from .watchdog import kill_local_engines

#: The placement of each kind of place (see :data:`.placement.PLACES`).
PLACEMENTS: dict[str, type[Placement]] = {"local": LocalPlacement, "allocation": AllocationPlacement,
                                          "new": NewAllocationPlacement}


@dataclass(frozen=True)
class JoinOptions:
    """How the engines join one world: ``kind`` "gloo" or "mpi", Gloo's network interface, each rank's environment."""

    kind: str
    iface: str | None
    env: dict[str, str]


class RankWorld:
    """The current world: its placement, client, rendezvous and reaper, and each rank's engine. ``backend`` is the
    session's training backend: its rank-side functions are what the ranks run (shipped by reference), and the
    session's other parts reach them through :attr:`backend`. ``call_timeout()`` is read at each call;
    ``on_failed()`` is told before a world that failed is ended."""

    def __init__(self, backend: Backend, call_timeout: Callable[[], float], on_failed: Callable[[], None]):
        self.backend = backend
        self.call_timeout, self.on_failed = call_timeout, on_failed
        self.placement: Placement | None = None
        self.client: ipp.Client | None = None
        self.rendezvous = None
        self.reaper = None
        self.view = None
        self.world: list[dict] = []
        self.engine_of: dict[int, int] = {}
        self._failed_at: tuple = (None, 0.0)  # the call whose part on some rank failed, and when that was seen

    @property
    def cluster(self) -> ipp.Cluster | None:
        return self.placement.cluster if self.placement is not None else None

    @property
    def job_id(self) -> str | None:
        return self.placement.job_id if self.placement is not None else None

    @property
    def ranks(self) -> list[int]:
        """The ranks of the current world, in order."""
        return sorted(self.engine_of)

    def start(self, kind: str, options: PlacementOptions, join: JoinOptions) -> list[dict]:
        """Start the engines where ``kind`` says and join them into one Horovod world; each rank's description.
        A failed start leaves nothing behind: no engines, no controller, no queued job."""
        self.placement = PLACEMENTS[kind](options)
        try:
            engines = self.placement.start(lambda: self._watch(kind, options.session_dir), self.get)
            self.client = self.placement.client
            if join.kind == "gloo":
                # joining has the start's deadline, not Gloo's own 30 s (imports on a loaded node take longer)
                self.rendezvous, envs = gloo_envs(self.backend, engines, options.ranks, join.iface,
                                                  options.start_timeout, options.session_dir)
            else:
                envs = mpi_envs(self.backend, engines)
            # every engine joins at once (hvd.init waits for all ranks)
            results = [self.client[e].apply_async(self.backend.join, {**join.env, **env})
                       for e, env in zip(engines.ids, envs)]
            self.world = [self.get(r, f"joining the world (engine {e})", options.start_timeout)
                          for e, r in zip(engines.ids, results)]
            check_one_world(self.world, len(engines.ids))
        except BaseException:
            self.on_failed()
            try:
                self.stop()
            except Exception as cleanup:  # the first error is the one to tell
                warnings.warn(f"stopping the ranks after a failed start: {cleanup}")
            raise
        self.engine_of = {w["rank"]: e for w, e in zip(self.world, engines.ids)}
        self.view = self.client[[self.engine_of[r] for r in self.ranks]]
        self.view.use_cloudpickle()  # the user's model and data functions travel by value
        return self.world

    def _watch(self, kind: str, session_dir: str) -> None:
        """A reaper that ends the ranks, the controller and a job of the ranks if this kernel dies unclosed."""
        self.reaper = start_reaper(self.placement.cluster_file, owner_socket() if kind == "allocation" else None,
                                   session_dir)

    def stop(self, force: bool = False) -> None:
        """End the current world: leave Horovod, stop the engines (and ask the allocation's owner to), the
        controller (and with it a batch job of the ranks) and the rendezvous — each even if another step fails.
        ``force`` (a rank hangs): no goodbye, and this machine's engines are killed at once."""
        stopped = False
        if self.client is None and self.placement is not None:
            self.client = self.placement.client  # a start that failed half-way
        try:
            if self.client is not None:
                if force:
                    kill_local_engines(self.world)
                elif self.world:
                    try:  # a rank that hangs does not hold the end of the world: its engine is stopped below
                        self.view.apply_async(self.backend.leave).get(timeout=10)
                    except Exception:
                        pass
                    if self.placement is not None and self.placement.kind != "local":
                        self.placement.shutdown_engines()  # engines in a batch job end themselves first
                self.client.close()
        finally:
            try:
                if self.placement is not None:
                    self.placement.stop()
                stopped = True
            finally:
                try:
                    if self.rendezvous is not None:
                        self.rendezvous.stop()
                finally:
                    # last: if this kernel dies before here, the reaper ends the rest; if stopping failed, it tries
                    stop_reaper(self.reaper, reap=not stopped)
                    self.placement = self.client = self.rendezvous = self.reaper = None
                    self.world, self.engine_of = [], {}

    def time_left(self) -> float | None:
        """Seconds of walltime the ranks have left, as the batch system says; None without a limit or a job."""
        try:
            return self.placement.time_left() if self.placement is not None else None
        except (OSError, RuntimeError, ValueError):
            return None

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine has gone (the controller is told at once by the engine's nanny)."""
        alive = set(self.client.ids) if self.client is not None else set()
        return sorted(r for r, e in self.engine_of.items() if e not in alive)

    @property
    def alive(self) -> bool:
        return bool(self.world) and self.client is not None and not self.dead_ranks()

    def raise_if_dead(self, what: str, wait: float = 0) -> None:
        """End the world and raise :class:`RankError` if a rank died (within ``wait`` seconds)."""
        deadline = time.monotonic() + wait
        while True:
            dead = self.dead_ranks()
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if dead:
            self.on_failed()
            self.stop()
            raise RankError(f"rank(s) {', '.join(map(str, dead))} died during {what} (the engine exited, or stopped "
                            "answering the controller's heartbeats for about 30 s); this world is gone: "
                            "recover(checkpoint) starts a new one from the last checkpoint")

    #: How long the other ranks have to end (or fail) after one rank's part of a call failed.
    FAILURE_GRACE_S = 5.0

    def raise_if_failed(self, ar, what: str) -> None:
        """End the world and raise :class:`RankError` if a rank's part of ``ar`` (a call on the whole world) failed
        and the others still run :attr:`FAILURE_GRACE_S` later: they wait for it in a collective that will not
        complete before its deadline."""
        # each rank's part: ipyparallel's message futures, whose result is the rank's value or its RemoteError
        parts = list(getattr(ar, "_children", []))
        if len(parts) != len(self.ranks) or ar.ready():
            return
        failed = [(r, found) for r, part in zip(self.ranks, parts)
                  if part.done() and isinstance(found := part.result(), Exception)]
        if not failed:
            return
        if self._failed_at[0] is not ar:  # held, not its id: a later call may reuse a freed one's id
            self._failed_at = (ar, time.monotonic())
        if time.monotonic() - self._failed_at[1] < self.FAILURE_GRACE_S:
            return
        self._failed_at = (None, 0.0)
        self.on_failed()
        self.stop(force=True)
        said = "; ".join(f"rank {r}: {getattr(e, 'ename', type(e).__name__)}: {getattr(e, 'evalue', e)}"
                         for r, e in failed)
        raise RankError(f"{what} failed on {said}. The other ranks waited for it (in a collective, most likely), so "
                        "the world was ended: recover(checkpoint) starts a new one from the last checkpoint")

    def require(self, what: str) -> None:
        """A world without a dead rank, for ``what``."""
        if not self.world:
            raise RuntimeError(f"no ranks for {what}: start() first, or recover(checkpoint) after a rank died")
        self.raise_if_dead(what)

    def call(self, fn, *args, **kwargs):
        """``fn(*args)`` on every rank; a world with a dead rank is ended and reported, not called."""
        name = getattr(fn, "__name__", "the call")
        self.require(name)
        return self.get(self.view.apply_async(fn, *args, **kwargs), name)

    def get(self, ar, what: str, timeout: float | None = None):
        """The result of ``ar`` within ``timeout`` (default ``call_timeout()``); past it the world is ended."""
        timeout = self.call_timeout() if timeout is None else timeout
        try:
            return ar.get(timeout=timeout)
        except ipp.error.TimeoutError:
            waiting = self._waiting_ranks(ar)
            self.on_failed()
            self.stop(force=True)
            raise RankError(f"{what} did not finish in {timeout:.0f} s{waiting}: the world was ended "
                            "(a rank may hang); recover(checkpoint) starts a new one") from None
        except ipp.error.CompositeError as e:
            lines = [f"rank {self._rank_of(info)}: {name}: {message}" for name, message, _tb, info in e.elist]
            error = RankError(f"{what} failed on " + "; ".join(sorted(lines)))
            error.engine_died = any(name == "EngineError" for name, *_ in e.elist)
            raise error from None
        except ipp.error.RemoteError as e:
            raise RankError(f"{what} failed: {e.ename}: {e.evalue}") from None

    def results(self, ar, what: str) -> list:
        """Each rank's result of a long call (a fit, a script): a death is reported as the death, not as the
        survivors' errors that follow from it."""
        try:
            return self.get(ar, what)
        except RankError as e:
            if e.engine_died:
                self.raise_if_dead(what, wait=5)
            self.on_failed()
            raise

    def _waiting_ranks(self, ar) -> str:
        """ ' on rank(s) …' for the ranks whose part of ``ar`` has not come back (calls on the whole world)."""
        ids = list(getattr(ar, "msg_ids", []))
        ranks = self.ranks
        if self.client is None or len(ids) != len(ranks):
            return ""
        left = [str(r) for r, m in zip(ranks, ids) if m in self.client.outstanding]
        return f" on rank(s) {', '.join(left)}" if left else ""

    def _rank_of(self, info) -> str:
        engine = info.get("engine_id") if isinstance(info, dict) else info
        for r, e in self.engine_of.items():
            if e == engine:
                return str(r)
        return f"(engine {engine})"
