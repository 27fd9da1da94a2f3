"""``lmtier plan``'s inputs, by a careless or hostile user: bad fleets, traces, sweeps,
goals and output paths are each one clear error line (exit 2) before any plan runs, never
a traceback; what outside reviews of the command found, kept here."""

from __future__ import annotations

import gzip
import json

import pytest

from lmtier.cli.parser import main
from lmtier.errors import ConfigError
from lmtier.plan.fleet import Fleet
from lmtier.plan.traces import mooncake, request_log

TINY = {"chunk_tokens": 4, "kv_bytes_per_token": 1, "prefill_tokens_per_s": 4.0}


def fleet(**settings) -> Fleet:
    return Fleet.from_dict({**TINY, **settings})


def test_what_an_outside_review_broke_is_a_clear_error_or_a_right_answer(tmp_path, capsys):
    """Found by trying the command as a careless or hostile user: each is one line and
    exit 2 (or the right plan), never a traceback."""
    fleet_file = tmp_path / "f.yaml"
    fleet_file.write_text("chunk_tokens: 4\nkv_bytes_per_token: 1\nprefill_tokens_per_s: 4\nmemory: 8\n")
    log = tmp_path / "log.jsonl"
    log.write_text("\n\n" + "".join(json.dumps({"t": i, "tokens": 8, "chunks": ["a", "b"]}) + "\n" for i in range(3)))
    base = ["plan", str(fleet_file), "--trace", f"log:{log}"]
    # --limit counts requests, not lines (two blank lines first)
    assert main([*base, "--limit", "2", "--json-out", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["requests"] == 2
    # output paths refused before any plan runs; a plot is a .png file
    for extra in (["--json-out", str(tmp_path)], ["--sweep", "memory=4,8", "--plot", str(tmp_path)],
                  ["--json-out", str(tmp_path / "no" / "p.json")]):  # fmt: skip
        assert main([*base, *extra]) == 2
    assert not (tmp_path.parent / f"{tmp_path.name}.png").exists()
    # a goal no value meets: exit 1
    assert main([*base, "--sweep", "memory=4,8", "--goal", "hit_ratio>=0.9"]) == 1
    assert "not met by any value swept" in capsys.readouterr().out
    assert main([*base, "--sweep", "instances=two"]) == 2
    # not finite, or the wrong type, in a fleet
    for bad in ("prefill_tokens_per_s: .nan", "request_ms: .inf", "costs: {disk: {gbps: .nan}}", "shared_size: 8"):
        fleet_file.write_text(f"chunk_tokens: 4\nkv_bytes_per_token: 1\n{bad}\n")
        assert main(base) == 2, bad
    capsys.readouterr()
    # bad lines of a request log, each naming its line
    fleet_file.write_text("chunk_tokens: 4\nkv_bytes_per_token: 1\n")
    for line, error in (('{"t": 0, "tokens": 8, "chunk_tokens": "4", "chunks": ["a"]}', "a positive count"),
                        ('{"t": 0, "tokens": 8, "chunk_tokens": 0, "chunks": ["a"]}', "a positive count"),
                        ('{"t": 0, "tokens": 8, "chunks": ["\\ud800"]}', "not text"),
                        ('{"t": 0, "tokens": 1' + "0" * 5000 + ', "chunks": []}', "not JSON"),
                        ('{"t": "0", "tokens": 8, "chunks": []}', "a time is a number"),
                        ('{"t": 0, "tokens": true, "chunks": []}', "a count of tokens")):  # fmt: skip
        log.write_text(line + "\n")
        assert main(base) == 2
        err = capsys.readouterr().err
        assert f"{log}:1:" in err and error in err, err
    assert main(["plan", str(fleet_file), "--trace", "synthetic:no_reuse:100000000000"]) == 2


@pytest.mark.parametrize(
    ("record", "error"),
    [
        ({"timestamp": 0, "input_length": 600, "hash_ids": 5}, "m.jsonl:1: a Mooncake request"),
        ({"timestamp": 0, "input_length": 600, "hash_ids": [1, None]}, "64-bit integers"),
        ({"timestamp": 0, "input_length": 600, "hash_ids": [1, 2**80]}, "64-bit integers"),
        ({"timestamp": 0, "input_length": 600, "hash_ids": [1, "x"]}, "64-bit integers"),
    ],
)
def test_a_malformed_mooncake_line_is_an_error_naming_it(tmp_path, record, error):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ConfigError, match=error):
        mooncake(path)
    path.write_text(json.dumps({"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}) + "\n")
    with pytest.raises(ConfigError, match="block is 512 tokens"):
        mooncake(path, chunk_tokens=256)


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"peers": "false"}, "peers must be true or false"),
        ({"instances": 2.5}, "instances must be an integer"),
        ({"instances": 10**8}, "at most 10000"),
        ({"costs": {"shared": {"gbps": 1, "msec": 30}}}, "costs are per medium"),
        ({"costs": {"memory": {"gbps": [1]}}}, "gbps and ms are numbers"),
        ({"shared": {"kind": "server", "size": "1TiB", "gbps": 10}}, "nothing else"),
    ],
)
def test_a_fleet_setting_of_the_wrong_type_or_shape_is_refused(settings, error):
    with pytest.raises(ConfigError, match=error):
        fleet(**settings)


def test_a_fleet_file_that_is_not_yaml_is_one_error_line(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("instances: [4\n")
    with pytest.raises(ConfigError, match="not a fleet"):
        Fleet.load(tmp_path / "bad.yaml")
    assert main(["plan", str(tmp_path / "bad.yaml"), "--trace", "synthetic:no_reuse:5"]) == 2
    assert "not a fleet" in capsys.readouterr().err


def test_a_goal_that_cannot_be_read_fails_before_any_plan_runs(tmp_path, capsys):
    (tmp_path / "f.yaml").write_text("chunk_tokens: 4\nkv_bytes_per_token: 1\n")
    args = ["plan", str(tmp_path / "f.yaml"), "--trace", "synthetic:no_reuse:5", "--sweep", "memory=4,8"]
    assert main([*args, "--goal", "hit_ratio>=1.2.3"]) == 2
    out = capsys.readouterr()
    assert "| memory |" not in out.out and "a goal" in out.err
    assert main(["plan", str(tmp_path / "f.yaml"), "--trace", "synthetic:no_reuse:5", "--plot", "x.png"]) == 2
    assert main([*args[:4], "--limit", "0"]) == 2
    assert main([*args[:3], "synthetic:no_reuse:-3"]) == 2
    assert main([*args[:4], "--sweep", "shared_size=1GiB"]) == 2


def test_what_a_second_outside_review_broke_is_a_clear_error_or_a_right_answer(tmp_path, capsys, monkeypatch):
    """Found by a careless or hostile user, again: settings whose figures overflow, a
    sweep value that is wrong after others were planned, a file without line breaks, an
    output that is an input, a number YAML reads as a string, a wall clock that steps
    back under the engine's request log."""
    from lmtier.engine import requestlog
    from lmtier.plan import traces

    fleet_file = tmp_path / "f.yaml"
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"t": i, "tokens": 8, "chunks": ["a", "b"]}) + "\n" for i in range(3)))
    base = ["plan", str(fleet_file), "--trace", f"log:{log}"]
    # figures that would overflow to inf and NaN: refused, one line each
    for bad in ("prefill_tokens_per_s: 1.0e-320", "request_ms: 1.0e+308", "costs: {disk: {gbps: 1.0e-300}}",
                "kv_bytes_per_token: 1099511627777", "memory: 1000000000000000000000000"):  # fmt: skip
        fleet_file.write_text(f"chunk_tokens: 4\n{bad}\n")
        assert main(base) == 2, bad
        err = capsys.readouterr().err
        assert "must lie between" in err or "at most" in err, err
    # YAML 1.1 reads 8e3 as a string: a number here; an upper-case suffix is YAML too
    upper = tmp_path / "F.YAML"
    upper.write_text("chunk_tokens: 4\nkv_bytes_per_token: 1\nprefill_tokens_per_s: 8e3\n")
    assert main(["plan", str(upper), "--trace", f"log:{log}", "--json-out", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["plans"][0]["fleet"]["prefill_tokens_per_s"] == 8000.0
    fleet_file.write_bytes(b"chunk_tokens: 4\n\xff\xfe\n")
    assert main(base) == 2 and str(fleet_file) in capsys.readouterr().err
    # every swept value is checked before any plan runs
    fleet_file.write_text("chunk_tokens: 4\nkv_bytes_per_token: 1\n")
    capsys.readouterr()
    assert main([*base, "--sweep", "instances=1,2,20000"]) == 2
    out = capsys.readouterr()
    assert "| instances |" not in out.out and "at most 10000" in out.err
    # an output that is an input, or no path at all: refused, the input untouched
    before = log.read_text()
    assert main([*base, "--json-out", str(log)]) == 2 and log.read_text() == before
    assert main([*base, "--json-out", str(fleet_file)]) == 2
    assert main([*base, "--json-out", ""]) == 2
    # a line without an end is read so far only
    monkeypatch.setattr(traces, "MAX_LINE", 100)
    log.write_text("x" * 1000)
    assert main(base) == 2 and "a line of more than 100 characters" in capsys.readouterr().err
    # a Mooncake trace's time going back is told in its own unit (ms)
    cake = tmp_path / "cake.jsonl"
    cake.write_text('{"timestamp": 5, "input_length": 512, "hash_ids": [1]}\n'
                    '{"timestamp": 4.5, "input_length": 512, "hash_ids": [1]}\n')  # fmt: skip
    with pytest.raises(ConfigError, match=r"4.5 ms after 5 ms"):
        mooncake(cake)
    # the engine's log: a wall clock stepping back does not make time go back in the file
    clock = iter([100.0, 90.0, 95.0, 101.0])
    monkeypatch.setattr(requestlog.time, "time", lambda: next(clock))
    written = requestlog.RequestLog(str(tmp_path / "engine.jsonl"), 1 << 20, chunk_tokens=4)
    for _ in range(4):
        written.write(8, [b"k" * 16])
    written.close()
    assert [r.t for r in request_log(tmp_path / "engine.jsonl")] == [100.0, 100.0, 100.0, 101.0]


def test_what_a_third_outside_review_broke_is_a_clear_error(tmp_path, capsys):
    """Each one error line and exit 2 before any plan runs, never a traceback nor a silent
    choice: a setting named by a number, a key given twice (YAML and JSON), a fleet file
    without end, a trace line nested past the JSON parser's depth, a time past 10^12 s,
    --json-out and --plot one file."""

    def refused(fleet_text: str, name: str = "f.yaml", trace: str = "synthetic:no_reuse:3", *extra: str) -> str:
        fleet_file = tmp_path / name
        fleet_file.write_text(fleet_text)
        assert main(["plan", str(fleet_file), "--trace", trace, *extra]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        return err

    assert "named by words, got 1" in refused("1: 2\n")
    assert "named by words" in refused("instances: 2\nfoo: 3\n1: 2\n")  # not a sort of str against int
    assert "'memory' is given twice (line 2)" in refused("memory: 1GiB\nmemory: 2\n")
    assert "'memory' is given twice" in refused('{"memory": "1GiB", "memory": "2GiB"}', "f.json")
    assert "a fleet is a file of 1024 KiB at most" in refused("#" * (1 << 20) + "\n")
    ok = "memory: 1GiB\nchunk_tokens: 512\n"
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "\n")
    assert "deep.jsonl:1: not JSON" in refused(ok, "f.yaml", f"mooncake:{tmp_path / 'deep.jsonl'}")
    (tmp_path / "late.jsonl").write_text(json.dumps({"timestamp": 1e300, "input_length": 600, "hash_ids": [1]}))
    assert "from 0 to 1e+12" in refused(ok, "f.yaml", f"mooncake:{tmp_path / 'late.jsonl'}")
    same = ["--sweep", "memory=1GiB,2GiB", "--json-out", str(tmp_path / "p.png"), "--plot", str(tmp_path / "p.png")]
    assert "--json-out and --plot are one file" in refused(ok, "f.yaml", "synthetic:no_reuse:3", *same)
    assert not (tmp_path / "p.png").exists()
    assert "gbps and ms are numbers" in refused(ok + "costs: {memory: {gbps: true}}\n")
    (tmp_path / "true.jsonl").write_text(json.dumps({"timestamp": 1, "input_length": 600, "hash_ids": [True, 2]}))
    assert "hash_ids are 64-bit integers" in refused(ok, "f.yaml", f"mooncake:{tmp_path / 'true.jsonl'}")
    for count in ("00", "\u00b2", "9" * 5000):  # zero, a digit Python's int() reads but is no count, too many digits
        assert "takes a positive number of requests" in refused(ok, "f.yaml", f"synthetic:no_reuse:{count}")
    # a compressed trace's suffix in any case
    (tmp_path / "T.JSONL.GZ").write_bytes(gzip.compress(b'{"timestamp": 0, "input_length": 600, "hash_ids": [1]}\n'))
    assert main(["plan", str(tmp_path / "f.yaml"), "--trace", f"mooncake:{tmp_path / 'T.JSONL.GZ'}"]) == 0
    capsys.readouterr()
    # the JSON is written under a name of its own, then renamed: a user's file named like
    # the output and ".partial" is left alone, and nothing is left beside the output
    (tmp_path / "out.json.partial").write_text("mine")
    assert main(["plan", str(tmp_path / "f.yaml"), "--trace", "synthetic:no_reuse:3",
                 "--json-out", str(tmp_path / "out.json")]) == 0  # fmt: skip
    assert json.loads((tmp_path / "out.json").read_text())["requests"] == 3
    assert (tmp_path / "out.json.partial").read_text() == "mine" and not list(tmp_path.glob(".out.json.*"))
    capsys.readouterr()
    # a tier under one chunk (a size without a unit is bytes) is said, not silently none
    (tmp_path / "small.yaml").write_text("memory: 64\nchunk_tokens: 512\n")
    assert main(["plan", str(tmp_path / "small.yaml"), "--trace", "synthetic:no_reuse:3"]) == 0
    assert "warning: memory: 64 bytes hold no chunk of 67,108,864 bytes: no memory tier" in capsys.readouterr().out


def test_the_calibrations_costs_are_a_line_through_each_lengths_median():
    """benchmarks/bench_plan.py's fit: cold prompts of 100 and 200 tokens, three times each
    (one slow outlier each): medians 1.1 s and 2.1 s, a line of 0.01 s a token (100
    tokens/s) from 0.1 s (the request's fixed time). Memory hits of 4 and 10 chunks (128
    tokens, 1 byte a token: 512 and 1,280 bytes) of which, less 0.1 s and the tail's 0.16
    s, the medians are 0.012 and 0.024 s: a round trip of 4 ms and 64,000 bytes a second."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_plan as bp

    cold = [[100, 1000.0], [100, 1100.0], [100, 3000.0], [200, 2100.0], [200, 2000.0], [200, 9000.0]]
    memory = [[n, (0.26 + load) * 1e3] for n, loads in ((4, (0.012, 0.011, 0.5)), (10, (0.024, 0.9, 0.023)))
              for load in loads]  # fmt: skip
    got = bp.fit({"cold": cold, "memory_hit": memory, "shared_hit": []}, kv_bytes_per_token=1)
    assert got["prefill_tokens_per_s"] == pytest.approx(100.0)
    assert got["request_ms"] == pytest.approx(100.0)
    assert got["memory"]["ms"] == pytest.approx(4.0, abs=1e-6)
    assert got["memory"]["gbps"] == pytest.approx(64_000 / 1e9)
    assert "shared" not in got


def test_the_fleet_calibration_merges_the_instances_logs_in_arrival_order(tmp_path):
    """benchmarks/bench_plan_fleet.py: each instance's request log, merged by arrival time,
    is one trace ``lmtier plan`` reads; the plan's round robin is matched to the router's
    instances in the way that agrees most."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_plan_fleet as bpf

    logs = [tmp_path / f"requests-{i}.jsonl" for i in range(3)]
    lines = {0: [(1.0, ["a"]), (4.0, ["a", "b"])], 1: [(2.0, ["c"]), (5.0, ["a"])], 2: [(3.0, ["a"])]}
    for i, rows in lines.items():
        logs[i].write_text("".join(json.dumps({"t": t, "tokens": 300, "chunk_tokens": 128, "chunks": c}) + "\n"
                                   for t, c in rows))  # fmt: skip
    seen = bpf.merged(logs, tmp_path / "all.jsonl")
    assert seen == [0, 1, 2, 0, 1]
    trace = request_log(tmp_path / "all.jsonl", chunk_tokens=128)
    assert [r.t for r in trace] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert trace[0].keys == trace[2].keys == trace[4].keys == trace[3].keys[:1] != trace[1].keys
    assert bpf.same_instance(seen) == 5
    assert bpf.same_instance([2, 0, 1, 2, 0]) == 5  # the router began elsewhere: the same partition
    assert bpf.same_instance([0, 1, 2, 1, 0]) == 3  # two requests swapped between instances
    peers, shared = bpf.description("peers", 2048), bpf.description("shared", 2048)
    assert peers.peers and peers.disk == 512 * 1024**2 and not peers.shared
    assert shared.shared == "server" and not shared.peers and not shared.disk


def test_a_request_logs_last_line_reaches_the_file_without_another_request(tmp_path):
    """An engine gone idle after one request: its line is in the file within about a second
    (the log's own flush), not only once another request comes; closing flushes and can be
    done twice."""
    from lmtier.engine.requestlog import RequestLog

    from conftest import eventually

    path = tmp_path / "idle.jsonl"
    log = RequestLog(str(path), 1 << 20, chunk_tokens=4)
    log.write(8, [b"k" * 16, b"j" * 16])
    assert eventually(lambda: path.read_text().count("\n") == 1, seconds=30)
    log.write(4, [b"k" * 16])
    log.close()
    log.close()
    assert [len(r.keys) for r in request_log(path)] == [2, 1]
    log.write(4, [b"x" * 16])  # after close: nothing, no error
    assert path.read_text().count("\n") == 2


def test_a_request_log_survives_a_crash_a_fifo_an_oversized_line_and_an_exit_without_close(tmp_path):
    """What an outside review of the request log broke: a line cut by a crash or a full
    disk made the whole log unreadable (now the reader leaves a cut last line out, and the
    next engine removes it before writing); a FIFO as the path blocked the engine's start
    (now a clear error); a line over half the bound rotated at every write, past the bound
    (now left out); a process ending without close lost its buffered lines (now flushed at
    the interpreter's exit)."""
    import os
    import subprocess
    import sys

    from lmtier.engine.requestlog import RequestLog

    path = tmp_path / "cut.jsonl"
    log = RequestLog(str(path), 1 << 20, chunk_tokens=4)
    for n in range(3):
        log.write(8 + n, [b"k" * 16])
    log.close()
    with open(path, "a") as f:
        f.write('{"t": 9.5, "tokens": 12, "chun')  # the crash
    assert [r.tokens for r in request_log(path)] == [8, 9, 10]  # the cut line left out
    again = RequestLog(str(path), 1 << 20, chunk_tokens=4)  # the next engine
    again.write(20, [b"j" * 16])
    again.close()
    assert [r.tokens for r in request_log(path)] == [8, 9, 10, 20]
    assert path.read_text().endswith("}\n") and "chun\n" not in path.read_text()

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        RequestLog(str(fifo), 1 << 20)

    small = tmp_path / "small.jsonl"
    bounded = RequestLog(str(small), 4096, chunk_tokens=4)
    for _ in range(5):
        bounded.write(4, [b"x" * 16] * 100)  # 3,500 bytes a line: over half of 4,096
        bounded.write(4, [b"y" * 16])
    bounded.close()
    assert not (tmp_path / "small.jsonl.1").exists() and small.stat().st_size <= 4096  # never rotated
    assert [len(r.keys) for r in request_log(small)] == [1] * 5

    exits = tmp_path / "exit.jsonl"
    script = (f"from lmtier.engine.requestlog import RequestLog\n"
              f"RequestLog({str(exits)!r}, 1 << 20).write(7, [b'k' * 16])\n")  # fmt: skip
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert [r.tokens for r in request_log(exits)] == [7]
