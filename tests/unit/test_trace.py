"""transfer.trace (points written and joined across files) and bench/hops.py (the hop
table `bench serve --trace` prints)."""

import json

import pytest

from transfer import trace
from transfer.bench.hops import format_hops, hop_table, in_window
from transfer.trace import TracePoint, mark, read_traces

P = TracePoint


@pytest.fixture
def tracing(tmp_path):
    trace.enable(tmp_path)
    yield tmp_path
    trace.enable(None)


def test_off_by_default_writes_nothing(tmp_path):
    assert not trace.enabled()
    mark(P.ROUTER_RECEIVED, "r1")
    assert list(tmp_path.iterdir()) == []


def test_marks_join_by_request_across_files_first_time_kept(tracing):
    mark(P.ROUTER_RECEIVED, "r1")
    mark(P.ROUTER_RECEIVED, "r2")
    mark(P.ROUTER_RECEIVED, "r1")  # a retry passes it again: the first time stays
    (tracing / "2.trace").write_text(
        "100.5 decode_arrived r1\n"
        "100.25 decode_arrived r1\n"  # an earlier time from the same file wins
        "bad line\n"
        "x decode_arrived r2\n"
        "101.0 no_such_point r2\n"
        "101.0 first_token r2"  # a last line without its newline (a process killed)
    )
    traces = read_traces(tracing)
    assert set(traces) == {"r1", "r2"}
    assert set(traces["r1"]) == {P.ROUTER_RECEIVED, P.DECODE_ARRIVED}
    assert traces["r1"][P.DECODE_ARRIVED] == 100.25
    assert traces["r1"][P.ROUTER_RECEIVED] <= traces["r2"][P.ROUTER_RECEIVED]
    assert traces["r2"][P.FIRST_TOKEN] == 101.0
    ids = "".join(p.read_text() for p in tracing.glob("*.trace"))
    assert ids.count(" router_received r1\n") == 2  # both lines are written


def test_hops_are_between_consecutive_points_each_request_passed():
    traces = {
        "a": {P.ROUTER_RECEIVED: 10.0, P.PREFILL_RECEIVED: 10.001, P.PREFILL_DONE: 10.021,
              P.FIRST_TOKEN: 10.03, P.ROUTER_FIRST_TOKEN: 10.032},
        "b": {P.ROUTER_RECEIVED: 20.0, P.PREFILL_RECEIVED: 20.003, P.PREFILL_DONE: 20.013,
              P.FIRST_TOKEN: 20.011},  # a stream: its first token before prefill's end
    }  # fmt: skip
    hops = {(h.start, h.end): h for h in hop_table(traces)}
    received = hops[P.ROUTER_RECEIVED, P.PREFILL_RECEIVED]
    assert received.count == 2
    assert (received.min_ms, received.max_ms) == pytest.approx((1.0, 3.0), abs=1e-6)
    assert received.p50_ms == pytest.approx(1.0, abs=1e-6)  # nearest rank
    assert received.p90_ms == pytest.approx(3.0, abs=1e-6)
    done = hops[P.PREFILL_DONE, P.FIRST_TOKEN]  # a hop here, listed once, not again as a span
    assert done.count == 2 and done.min_ms == pytest.approx(-2.0, abs=1e-6)
    assert [h.name for h in hop_table(traces)].count(done.name) == 1
    assert hops[P.FIRST_TOKEN, P.ROUTER_FIRST_TOKEN].count == 1
    total = hops[P.ROUTER_RECEIVED, P.ROUTER_FIRST_TOKEN]
    assert (total.count, total.p50_ms) == (1, pytest.approx(32.0, abs=1e-6))
    # the hops in path order, then the spans
    names = [h.name for h in hop_table(traces)]
    assert names[0] == "router_received -> prefill_received"
    assert names[-1] == "router_received -> router_first_token"


def test_windows_pick_requests_by_their_arrival_at_the_router():
    traces = {
        "early": {P.ROUTER_RECEIVED: 1.0, P.ROUTER_FIRST_TOKEN: 1.5},
        "late": {P.ROUTER_RECEIVED: 5.0, P.ROUTER_FIRST_TOKEN: 9.0},
        "never_routed": {P.DECODE_ARRIVED: 1.2},
    }
    assert set(in_window(traces, [(0.0, 2.0)])) == {"early"}
    assert set(in_window(traces, [(0.0, 2.0), (4.0, 6.0)])) == {"early", "late"}
    assert in_window(traces, [(2.0, 4.0)]) == {}


def test_the_table_has_a_column_per_level_and_a_dash_where_a_level_lacks_a_hop():
    one = {"a": {P.ROUTER_RECEIVED: 0.0, P.PREFILL_RECEIVED: 0.002}}
    two = {"b": {P.ROUTER_RECEIVED: 0.0, P.DECODE_ARRIVED: 0.004}}
    lines = format_hops({"C=1": hop_table(one), "C=32": hop_table(two)}).splitlines()
    assert lines[0].split()[-2:] == ["C=1", "C=32"]
    row = next(line for line in lines if line.startswith("router_received -> prefill_received"))
    assert row.split()[-4:] == ["2.0", "/", "2.0", "-"]


def test_the_trace_command_reads_a_directory_and_names_what_is_wrong(tmp_path, capsys):
    from transfer.cli import main

    (tmp_path / "1.trace").write_text("10.000 router_received r\n10.004 prefill_received r\n")
    assert main(["trace", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 1
    (hop,) = report["hops_ms"]
    assert (hop["start"], hop["end"], hop["count"]) == ("router_received", "prefill_received", 1)
    assert hop["p50_ms"] == pytest.approx(4.0, abs=1e-3)
    assert main(["trace", str(tmp_path)]) == 0
    assert "router_received -> prefill_received" in capsys.readouterr().out
    assert main(["trace", str(tmp_path / "missing")]) == 2
    assert "DIR:" in capsys.readouterr().err
    (tmp_path / "1.trace").write_text("")
    assert main(["trace", str(tmp_path)]) == 2
    assert "no trace lines" in capsys.readouterr().err
