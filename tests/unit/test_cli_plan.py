import json

import pytest

from transfer.cli import main

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"


def run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_qwen3_next_reference_numbers(capsys):
    report = run_json(capsys, "--model", "qwen3-next-80b-a3b", "--tp", "1")
    assert report["linear_layer_state_bytes"] == {"ssm": 1048576, "conv": 49152}
    assert report["attention_layer_kv_bytes_per_token"] == 2048
    assert report["crossover_tokens"] == 536
    assert (report["num_linear_layers"], report["num_attention_layers"]) == (36, 12)
    for key in ("num_kv_blocks", "num_state_slots", "block_size", "page_bytes", "padding_bytes"):
        assert isinstance(report["memory_plan"][key], int)


def test_kimi_linear_reference_numbers(capsys):
    report = run_json(capsys, "--model", "kimi-linear-48b-a3b", "--tp", "1")
    assert report["linear_layer_state_bytes"] == {"ssm": 1048576, "conv": 73728}
    assert report["attention_layer_kv_bytes_per_token"] == 1152
    assert report["crossover_tokens"] == 975


def test_hf_config_and_tp(capsys):
    report = run_json(capsys, "--hf-config", str(FIXTURES / "qwen3_next_config.json"), "--tp", "4")
    assert report["linear_layer_state_bytes"] == {"ssm": 262144, "conv": 12288}
    assert report["attention_layer_kv_bytes_per_token"] == 1024


def test_table_output_and_plot(capsys, tmp_path):
    plot = tmp_path / "crossover.png"
    assert (
        main(
            [
                "plan",
                "--model",
                "tiny-kimi-linear",
                "--gpu-mem",
                "1GiB",
                "--max-seqs",
                "8",
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "crossover" in out and "padding waste" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt-5"], "presets: qwen3-next-80b-a3b"),
        (
            ["--model", "tiny-qwen3-next", "--tp", "3"],
            "layer 0 (gdn): tp=3 does not divide the 4 k_heads",
        ),
        (["--model", "tiny-qwen3-next", "--gpu-mem", "1MiB"], "missing"),
        (["--model", "tiny-qwen3-next", "--gpu-mem", "lots"], "--gpu-mem: cannot parse 'lots'"),
        (["--model", "tiny-qwen3-next", "--mem-fraction", "1.5"], "--mem-fraction"),
    ],
)
def test_bad_input_exits_2_with_message(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bad_config_names_field(capsys, tmp_path):
    data = json.loads((FIXTURES / "kimi_linear_config.json").read_text())
    del data["kv_lora_rank"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--hf-config", str(path)]) == 2
    assert "missing field 'kv_lora_rank'" in capsys.readouterr().err


def test_ssm_dtype_and_model_dtype(capsys):
    auto = run_json(capsys, "--model", "qwen3-next-80b-a3b")
    fp32 = run_json(capsys, "--model", "qwen3-next-80b-a3b", "--ssm-dtype", "float32")
    assert auto["cache_dtype_bytes"] == {"kv": 2, "ssm": 2, "conv": 2}
    assert fp32["linear_layer_state_bytes"] == {"ssm": 2 * 1048576, "conv": 49152}
    tiny = run_json(capsys, "--model", "tiny-qwen3.5", "--gpu-mem", "1GiB")
    assert (tiny["dtype"], tiny["cache_dtype_bytes"]) == ("float32", {"kv": 4, "ssm": 4, "conv": 4})


def test_model_directory(capsys, tmp_path):
    (tmp_path / "config.json").write_text((FIXTURES / "qwen3_next_config.json").read_text())
    report = run_json(capsys, "--model", str(tmp_path), "--tp", "4")
    assert report["linear_layer_state_bytes"] == {"ssm": 262144, "conv": 12288}
    assert main(["plan", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "config.json").unlink()
    assert main(["plan", "--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
