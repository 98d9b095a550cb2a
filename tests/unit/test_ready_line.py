"""A serve process's READY line, written by the process and read by the launchers: the
router's HTTP port travels in it, since with --http-port 0 only the router knows it."""

import subprocess
import sys

from transfer.serving.child_process import ready_line
from transfer.serving.launch.procs import ServeProcess


def started(tmp_path, line: str) -> ServeProcess:
    stdout = tmp_path / "router.out"
    stdout.write_text(f"some log\n{line}\n")
    popen = subprocess.Popen([sys.executable, "-c", "pass"])
    popen.wait()
    return ServeProcess("router", popen, stdout, tmp_path / "router.log")


def test_a_router_with_an_http_front_announces_its_port(tmp_path):
    proc = started(tmp_path, ready_line("router", "127.0.0.1:4100", 4101, http_port=4102))
    assert proc.poll_ready()
    assert (proc.address, proc.metrics_port, proc.http_port) == ("127.0.0.1:4100", 4101, 4102)


def test_an_instance_without_one_reads_as_port_0(tmp_path):
    proc = started(tmp_path, ready_line("decode", "127.0.0.1:4200", 0))
    assert proc.poll_ready()
    assert (proc.address, proc.http_port) == ("127.0.0.1:4200", 0)
    assert "http_port" not in ready_line("decode", "127.0.0.1:4200", 0)
