"""The hub side's fault logic alone, with a scheduler runner that fails on demand: UNKNOWN is never ENDED, the
queue backs off while the scheduler is down and recovers when it answers, poll keeps a running server for the
site's grace, stop never hangs on a dead controller, and the orphan sweep cancels only this hub's unowned jobs (on
the bed, tests/test_spawner_faults.py does the same against the real Slurm)."""
import asyncio
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st

from jupyter_hpcdl.spawner.hub import install
from jupyter_hpcdl.commands import Result
from jupyter_hpcdl.spawner import commands
from jupyter_hpcdl.spawner.orphans import JobMark, OrphanSweeper, find_suspects, is_orphan
from jupyter_hpcdl.spawner.queue import JobQueue
from jupyter_hpcdl.batchsystems.scheduler import ENDED, PENDING, RUNNING, UNKNOWN, JobInfo
from jupyter_hpcdl.batchsystems.slurm import Slurm


class FlakyScheduler:
    """A runner that answers like squeue/scontrol/scancel, or fails (down) or hangs (frozen) when told to. ``named``
    and ``comments`` answer the sweep's listing of the hub's job ids and its reading of one job's comment."""

    def __init__(self, listing: str = "", named: str = "", comments: dict | None = None):
        self.listing, self.named, self.comments, self.mode, self.calls = listing, named, comments or {}, "up", []

    async def __call__(self, argv, timeout=60, **kw):
        self.calls.append(list(argv))
        if self.mode == "down":
            return Result(tuple(argv), 1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)")
        if self.mode == "frozen":
            raise RuntimeError(f"{argv[0]} did not answer in {timeout:.0f} s")
        cmd = [a for a in argv if not a.startswith("-") and a not in ("sudo", "alice", "bob")][0]
        if cmd == "squeue" and any(a.startswith("--name=") for a in argv):
            return Result(tuple(argv), 0, self.named, "")
        if cmd == "squeue" and any(a.startswith("--jobs=") for a in argv):
            job = next(a for a in argv if a.startswith("--jobs="))[7:]
            return Result(tuple(argv), 0, self.comments.get(job, "(null)") + "\n", "")
        if cmd == "squeue":
            return Result(tuple(argv), 0, self.listing, "")
        if cmd == "scontrol":
            return Result(tuple(argv), 1, "", "slurm_load_jobs error: Invalid job id specified")
        return Result(tuple(argv), 0, "", "")


def line(job_id, state="RUNNING", user="alice", host="node1"):
    return f"{job_id}|{state}|None|N/A|{host}|{user}\n"


@pytest.mark.timing
def test_unreachable_scheduler_is_unknown_never_ended_and_backs_off():
    flaky = FlakyScheduler(line("7"))

    async def scenario():
        q = JobQueue(Slurm(), interval=0.05, runner=flaky, max_backoff=0.4)
        assert (await q.job("7")).phase == RUNNING
        flaky.mode = "down"
        await asyncio.sleep(0.06)
        seen = [(await q.job("7", max_age=0)).phase]
        asked = len(flaky.calls)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:  # 1 s of polls as fast as possible
            seen.append((await q.job("7", max_age=0)).phase)
            await asyncio.sleep(0.01)
        backed_off = len(flaky.calls) - asked
        unknown = await q.job("7", max_age=0)
        flaky.mode = "frozen"
        await asyncio.sleep(0.5)
        frozen = await q.job("7", max_age=0)
        flaky.mode = "up"
        await asyncio.sleep(0.5)
        back = await q.job("7", max_age=0)
        return q, seen, backed_off, unknown, frozen, back

    q, seen, backed_off, unknown, frozen, back = asyncio.run(scenario())
    assert set(seen) == {UNKNOWN}  # never ENDED (nor None) while the scheduler cannot be asked
    assert backed_off <= 6, f"{backed_off} queries in 1 s of polling: no backoff"  # 0.05, 0.1, 0.2, 0.4, 0.4 ...
    assert "Unable to contact" in unknown.reason and unknown.batch_host == "node1"
    assert frozen.phase == UNKNOWN and "did not answer" in frozen.reason
    assert back.phase == RUNNING and q.reachable and q.unreachable_for() == 0


def test_a_job_asked_about_during_an_outage_is_unknown_not_forgotten():
    flaky = FlakyScheduler("")  # job 9 is not in the listing: its details are asked for

    async def scenario():
        q = JobQueue(Slurm(), interval=0.01, runner=flaky)
        forgotten = await q.job("9")
        q2 = JobQueue(Slurm(), interval=0.01, runner=flaky)
        await q2.refresh()
        flaky.mode = "down"
        return forgotten, await q2.job("9")

    forgotten, during = asyncio.run(scenario())
    assert forgotten is None  # "Invalid job id": the scheduler forgot it
    assert during.phase == UNKNOWN


def make_spawner(flaky, **traits):
    from jupyter_hpcdl.spawner.spawner import HpcdlSpawner

    spawner = HpcdlSpawner(user=SimpleNamespace(name="alice", url="/user/alice/"), orm_spawner=None, **traits)
    spawner.job_id = "7"
    spawner.hub_wide.queues[("slurm", spawner.queue_interval)] = JobQueue(Slurm(), spawner.queue_interval, runner=flaky,
                                                                         max_backoff=spawner.queue_max_backoff)
    return spawner


@pytest.fixture
def fresh_queues():
    queues = install().queues  # the hub-wide queues of this process
    saved = dict(queues)
    queues.clear()
    yield
    queues.clear()
    queues.update(saved)


def test_poll_keeps_a_running_server_for_the_sites_grace_then_says_why(fresh_queues):
    flaky = FlakyScheduler(line("7"))
    spawner = make_spawner(flaky, queue_interval=0.01, unknown_grace=0.3, queue_max_backoff=0.05)

    async def scenario():
        assert await spawner.poll() is None
        flaky.mode = "frozen"
        during = [await spawner.poll()]
        await asyncio.sleep(0.1)
        during.append(await spawner.poll())
        await asyncio.sleep(0.3)
        after = await spawner.poll()
        return during, after

    during, after = asyncio.run(scenario())
    assert during == [None, None]
    assert after == 1 and "did not answer for" in spawner.last_end and "0 s" in spawner.last_end


def test_poll_recovers_when_the_scheduler_answers_within_the_grace(fresh_queues):
    flaky = FlakyScheduler(line("7"))
    spawner = make_spawner(flaky, queue_interval=0.01, unknown_grace=60, queue_max_backoff=0.05)

    async def scenario():
        flaky.mode = "down"
        first = await spawner.poll()
        flaky.mode = "up"
        await asyncio.sleep(0.1)
        return first, await spawner.poll()

    assert asyncio.run(scenario()) == (None, None)
    assert spawner.job_id == "7" and spawner.last_end == ""


@pytest.mark.timing
def test_stop_with_a_dead_controller_ends_in_time_and_leaves_the_job_to_the_sweep(fresh_queues, monkeypatch):
    flaky = FlakyScheduler(line("7"))
    spawner = make_spawner(flaky, queue_interval=0.01, cancel_timeout=2, queue_max_backoff=0.05)
    monkeypatch.setattr(commands, "run", flaky)  # scancel goes to the same dead controller
    flaky.mode = "down"
    t0 = time.monotonic()
    asyncio.run(spawner.stop())
    assert time.monotonic() - t0 < 4
    assert spawner.job_id == "" and "could not be cancelled" in spawner.last_end and "as soon as" in spawner.last_end
    assert any("scancel" in c for c in flaky.calls)


@given(st.text(max_size=30), st.text(max_size=30))
def test_job_marks_round_trip_and_stay_safe(user, server):
    comment = JobMark("hub-1", user, server).comment()
    assert all(c.isascii() and (c.isalnum() or c in "._-:%") for c in comment)
    assert JobMark.parse(comment) == JobMark("hub-1", user, server)


def test_suspects_are_this_hubs_named_jobs_that_no_server_owns():
    jobs = {j.job_id: j for j in [JobInfo("1", RUNNING, "RUNNING", user="alice"),
                                  JobInfo("2", PENDING, "PENDING", user="alice"),
                                  JobInfo("5", ENDED, "COMPLETED", user="alice"),
                                  JobInfo("6", RUNNING, "RUNNING", user="bob")]}
    assert [j.job_id for j in find_suspects(jobs, ["1", "2", "5", "9"], owned={"1"})] == ["2"]


def test_only_a_comment_that_is_exactly_this_hubs_mark_for_the_jobs_owner_makes_an_orphan():
    alice_job = JobInfo("2", RUNNING, "RUNNING", user="alice")
    mark = JobMark("hub", "alice", "lab").comment()
    assert is_orphan(alice_job, mark + "\n", "hub") == JobMark("hub", "alice", "lab")
    assert is_orphan(alice_job, JobMark("other", "alice").comment() + "\n", "hub") is None  # another hub's
    assert is_orphan(JobInfo("4", RUNNING, "RUNNING", user="bob"), mark + "\n", "hub") is None  # bob forged alice's
    assert is_orphan(alice_job, f"x\n{mark}\n", "hub") is None  # a comment with a newline is never a mark
    assert is_orphan(alice_job, "(null)\n", "hub") is None


def test_sweeper_cancels_as_the_user_tells_them_and_skips_an_outage(monkeypatch):
    mark = JobMark("hub", "alice", "lab2").comment()
    flaky = FlakyScheduler(line("2") + line("1") + line("3", user="bob"), named="1\n2\n3\n",
                           comments={"2": mark, "3": mark})  # bob's job 3 carries alice's mark: ignored
    monkeypatch.setattr(commands, "run", flaky)  # scancel goes to the same scheduler
    told = []
    q = JobQueue(Slurm(), interval=0.001, runner=flaky)
    sweeper = OrphanSweeper(q, "hub", "jupyterhub-hpcdl", owned=lambda: {"1"},
                            notify=lambda m, msg: told.append((m, msg)), interval=0.001)

    async def scenario():
        flaky.mode = "down"
        assert await sweeper.sweep() == []
        flaky.mode = "up"
        await asyncio.sleep(0.01)
        first = await sweeper.sweep()
        await asyncio.sleep(0.01)
        return first, await sweeper.sweep()

    first, second = asyncio.run(scenario())
    assert first == [] and [a.job_id for a in second] == ["2"] and second[0].cancelled
    assert ["sudo", "-n", "-u", "alice", "--", "scancel", "2"] in flaky.calls
    assert not any(c[-2:] == ["scancel", "3"] for c in flaky.calls)
    assert told[0][0] == JobMark("hub", "alice", "lab2") and "cancelled by the hub" in told[0][1]
