"""Flags and pure pieces of `bench vllm`, `up --engine vllm` and the router's vLLM backend."""

import pytest

from transfer.bench.vllm_metrics import ConnectorTotals, connector_totals
from transfer.bench.vllm_pd import ConnectorRun
from transfer.bench.vllm_report import ratios, row
from transfer.cli.bench_vllm import connectors, tp_pairs
from transfer.cli.vllm_args import vllm_model_dir, vllm_python
from transfer.errors import InvalidInput
from transfer.serving.launch.vllm_servers import Connector
from transfer.serving.openai.vllm_backend import parse_server_url


def test_tp_pairs_and_connectors_parse_or_name_the_flag():
    assert tp_pairs("1:1, 2:1") == [(1, 1), (2, 1)]
    assert connectors("nixl,pdxfer") == [Connector.NIXL, Connector.PDXFER]
    for text in ("1", "0:1", "a:b", "1:1,"):
        with pytest.raises(InvalidInput, match="--tp-pairs"):
            tp_pairs(text)
    with pytest.raises(InvalidInput, match="--connectors"):
        connectors("lmcache")


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "https://h:1", "http://h", "http://h:1/v1"])
def test_router_backend_urls_name_the_flag(url):
    with pytest.raises(InvalidInput, match="--decode"):
        parse_server_url(url, "--decode")
    assert parse_server_url("http://[::1]:8000", "--decode") == ("::1", 8000)


def test_vllm_needs_a_checkpoint_directory_and_an_interpreter(tmp_path):
    with pytest.raises(InvalidInput, match="--model"):
        vllm_model_dir("tiny-qwen3-next")
    (tmp_path / "config.json").write_text("{}")
    assert vllm_model_dir(str(tmp_path)) == tmp_path
    with pytest.raises(InvalidInput, match="--vllm-python"):
        vllm_python(str(tmp_path / "config.json"))  # not executable


METRICS = """\
# HELP vllm:nixl_bytes_transferred Histogram of bytes transferred per NIXL KV Cache transfers.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf"} 2.0
vllm:nixl_bytes_transferred_count{engine="0"} 2.0
vllm:nixl_bytes_transferred_sum{engine="0"} 3000.0
vllm:nixl_bytes_transferred_count{engine="1"} 1.0
vllm:nixl_bytes_transferred_sum{engine="1"} 500.0
# TYPE vllm:nixl_num_descriptors histogram
vllm:nixl_num_descriptors_count{engine="0"} 2.0
vllm:nixl_num_descriptors_sum{engine="0"} 26.0
"""


def test_connector_totals_sum_every_label_set():
    totals = connector_totals(METRICS, "nixl")
    assert totals == ConnectorTotals(3, 3500.0, 26.0, 0.0)
    assert connector_totals(METRICS, "pdxfer") == ConnectorTotals(0, 0.0, 0.0, 0.0)


def test_report_rows_and_ratios():
    nixl = ConnectorRun(Connector.NIXL, 1, 1, ConnectorTotals(2, 2e6, 26, 0.02),
                        (0.1, 0.3), ((1, 2), (3, 4)), ((1, 2), (3, 4)))  # fmt: skip
    pdx = ConnectorRun(Connector.PDXFER, 1, 1, ConnectorTotals(2, 1e6, 6, 0.01),
                       (0.1, 0.2), ((1, 2), (3, 4)), ((1, 2), (3, 5)))  # fmt: skip
    assert "1.000" in row(nixl) and "equal to colocated" in row(nixl)
    assert "DIFFER" in row(pdx)
    (line,) = ratios([nixl, pdx])
    assert "bytes 0.500x" in line and "descriptors 0.231x" in line
    assert "tokens equal between connectors" in line
    slow_nixl = ConnectorRun(Connector.NIXL, 1, 1, ConnectorTotals(2, 2e6, 26, 30.0),
                             (0.1, 0.3), ((1, 2), (3, 4)), ((1, 2), (3, 4)))  # fmt: skip
    (line,) = ratios([slow_nixl, pdx])
    assert "transfer time 0.00033x" in line
    failed = ConnectorRun(Connector.PDXFER, 2, 1, error="no module transfer.vllm.connector")
    assert "failed: no module" in row(failed) and ratios([nixl, failed]) == []


def test_a_refused_completion_carries_the_servers_status_and_message():
    import http.server
    import json
    import threading

    from transfer.errors import PeerUnavailable
    from transfer.serving.openai.schema import ApiError
    from transfer.serving.openai.vllm_backend import post_completion

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"error": {"message": "KV transfer failed"}}).encode()
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ApiError, match="KV transfer failed") as refused:
            post_completion(url, [1, 2, 3], 2, timeout_s=10)
        assert refused.value.status == 500 and url in str(refused.value)
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(PeerUnavailable, match="unreachable"):
        post_completion(url, [1, 2, 3], 2, timeout_s=10)  # nothing listens there now
