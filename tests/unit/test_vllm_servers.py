"""The vLLM server launcher's command line and environment (no vLLM needed)."""

import json
from pathlib import Path

import pytest

from transfer.serving.launch.vllm_servers import (
    Connector,
    VllmServerSpec,
    connector_config,
    connector_env,
    omp_binds,
    vllm_command,
    vllm_environment,
)


@pytest.mark.parametrize(
    ("tps", "cpus", "expected"),
    [
        ([2], [0, 1], ["0|1"]),
        ([1, 1], [0, 1], ["0", "1"]),
        # More ranks than CPUs: each server keeps CPUs of its own while it can.
        ([2, 1], [0, 1], ["0|0", "1"]),
        ([1, 2], [0, 1], ["0", "1|1"]),
        ([1, 1, 1], [0, 1], ["0", "1", "0"]),
        ([2, 2], [0, 1, 2], ["0|0", "1|1"]),
        ([1, 2], [0, 1, 2, 3, 4, 5], ["0,1", "2,3|4,5"]),
        ([2], [4, 5, 6], ["4|5"]),
        ([1], [3, 1, 2], ["1,2,3"]),
    ],
)
def test_omp_binds_give_each_rank_its_own_cpus(tps, cpus, expected):
    assert omp_binds(tps, cpus) == expected


def test_command_carries_connector_config_as_json():
    spec = VllmServerSpec(
        model=Path("/models/tiny"), port=8123, tp=2,
        kv_transfer_config=connector_config(Connector.PDXFER),
    )  # fmt: skip
    cmd = vllm_command(spec)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert config == {
        "kv_connector": "PdxferConnector",
        "kv_connector_module_path": "transfer.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
    }
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--port") + 1] == "8123"
    assert spec.url == "http://127.0.0.1:8123"


def test_tp_servers_get_a_thread_binding_unless_given():
    spec = VllmServerSpec(model=Path("m"), port=1, tp=2)
    assert vllm_environment(spec)["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    given = VllmServerSpec(model=Path("m"), port=1, tp=2, env={"VLLM_CPU_OMP_THREADS_BIND": "7|7"})
    assert vllm_environment(given)["VLLM_CPU_OMP_THREADS_BIND"] == "7|7"


def test_nixl_needs_its_layout_and_a_side_channel_port_pdxfer_needs_nothing():
    env = connector_env(Connector.NIXL)
    assert env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 0
    assert connector_config(Connector.NIXL)["kv_buffer_device"] == "cpu"
    assert connector_env(Connector.PDXFER) == {}
