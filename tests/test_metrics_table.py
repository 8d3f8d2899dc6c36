"""The kernel's table of the ranks' metrics: each record once, however often a rank's publication (which repeats
its last records) is read, and only the new tail of a publication read."""
from jupyter_hpcdl.training.metrics import MetricsTable


def _publications(origin: str, rank: int, count: int, outbox: int = 4) -> list[dict]:
    """What a rank publishes after each of ``count`` batches: its last ``outbox`` records, in order."""
    records = [{"rank": rank, "epoch": 1, "batch": b, "time": b, "loss": 1.0 / (b + 1), "step_time_s": 0.1 + rank,
                "seq": b, "origin": origin} for b in range(count)]
    return [{"rank": rank, "records": records[max(0, i + 1 - outbox):i + 1]} for i in range(count)]


def test_every_record_once_whether_a_publication_is_read_often_seldom_or_twice():
    table = MetricsTable()
    a, b = _publications("n1:1", 0, 10), _publications("n2:1", 1, 10)
    assert table.add([a[0], b[0]]) == 2
    assert table.add([a[0], b[0]]) == 0, "a publication read twice"
    assert table.add([a[2], b[1]]) == 3, "rank 0 published twice between two reads"
    assert table.add([a[9], b[9]]) == 4 + 4, "read too seldom: the outbox's last 4 of each (the rest were lost)"
    frame = table.frame()
    assert sorted(frame[frame["rank"] == 0]["batch"]) == [0, 1, 2, 6, 7, 8, 9]
    assert table.latest()[1]["batch"] == 9 and table.latest_step_times() == {0: 0.1, 1: 1.1}


def test_a_restarted_rank_is_a_new_origin_and_plain_records_still_count():
    table = MetricsTable()
    table.add(_publications("n1:1", 0, 3)[-1:])
    assert table.add(_publications("n1:2", 0, 2)[-1:]) == 2, "a new process: its records from its first"
    plain = {"rank": 3, "epoch": 1, "batch": 0, "time": 5, "step_time_s": 0.2}
    assert table.add([plain, plain]) == 1
    assert table.add([{"rank": 0, "records": []}, None, {}]) == 0


def test_the_frame_grows_with_the_records_and_what_a_caller_adds_to_it_stays_theirs():
    table = MetricsTable()
    table.add(_publications("n1:1", 0, 3)[-1:])
    first = table.frame()
    first["mine"] = 1
    table.add(_publications("n1:1", 0, 5)[-1:])
    assert list(table.frame()["batch"]) == [0, 1, 2, 3, 4] and "mine" not in table.frame()
    table.add([{"rank": 1, "epoch": 1, "batch": 0, "time": 9, "metrics": {"accuracy": 0.5}}])
    frame = table.frame()
    assert list(frame["accuracy"].isna()) == [True] * 5 + [False], "a new metric: a column for it"


def test_a_ranks_typical_step_time_is_not_made_by_one_slow_step():
    table = MetricsTable()
    times = [0.1] * 5 + [4.0] + [0.1] * 2  # the sixth step paused (tracing, a loaded machine)
    table.add([{"rank": 0, "epoch": 1, "batch": b, "time": b, "step_time_s": t} for b, t in enumerate(times)])
    table.add([{"rank": 1, "epoch": 1, "batch": b, "time": b, "step_time_s": 0.3} for b in range(3)])
    assert table.typical_step_times() == {0: 0.1, 1: 0.3}
    table.add([{"rank": 0, "epoch": 1, "batch": b, "time": b, "step_time_s": 2.0} for b in range(8, 8 + 5)])
    assert table.typical_step_times()[0] == 2.0, "steps that stay slow are the rank's step time"
