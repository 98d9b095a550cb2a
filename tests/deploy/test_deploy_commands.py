"""Every `pdxfer ...` command line in the rendered manifests, expanded as the kubelet
expands `$(VAR)`, parses with the real CLI, and agrees with the pod around it."""

from __future__ import annotations

import subprocess
from typing import Any

from k8s_manifests import (
    CommandLine,
    command_lines,
    geometry_of,
    is_shell,
    is_vllm,
    kustomizations,
    parse_pdxfer,
    rendered,
)

from transfer.presets import load_geometry
from transfer.units import parse_size

GPU = "nvidia.com/gpu"


def _parse_all(objects) -> tuple[list[tuple[CommandLine, Any]], list[str]]:
    parsed, errors = [], []
    for line in command_lines(objects):
        if line.missing:
            errors.append(f"{line.label}: undefined references {sorted(set(line.missing))}")
            continue
        if is_shell(line):  # test_shell_scripts_are_valid_sh
            continue
        if is_vllm(line):  # test_deploy_vllm
            continue
        try:
            parsed.append((line, parse_pdxfer(line.argv)))
        except ValueError as exc:
            errors.append(f"{line.label}: {exc}")
    return parsed, errors


def _parsed(objects) -> list[tuple[CommandLine, Any]]:
    """The command lines that parse; test_every_command_line_parses reports the others."""
    return _parse_all(objects)[0]


def _gpus(line: CommandLine) -> int:
    resources = line.container.get("resources", {})
    requested = int(resources.get("requests", {}).get(GPU, 0))
    assert requested == int(resources.get("limits", {}).get(GPU, 0)), line.label
    return requested


def test_every_command_line_parses(objects):
    parsed, errors = _parse_all(objects)
    assert not errors, "\n".join(errors)
    assert parsed or all(is_shell(line) for line in command_lines(objects))


def test_serve_roles_match_pod_components(objects):
    for line, args in _parsed(objects):
        if args.command == "serve":
            component = line.pod.labels["app.kubernetes.io/component"]
            assert component.removesuffix("-worker") == args.role, line.label


def test_gpus_match_tensor_parallel_ranks(objects):
    """One GPU per TP rank on each node, and a TP the model's heads allow."""
    for line, args in _parsed(objects):
        gpus = _gpus(line)
        if args.command == "serve" and args.role == "router":
            assert gpus == 0, line.label
        elif args.command == "serve":
            assert args.device == "cuda" and gpus * args.nnodes == args.tp, (
                f"{line.label}: {gpus} GPU(s) x {args.nnodes} node(s) for --tp {args.tp}"
            )
            geometry_of(args.model).check_tp(args.tp)
        elif args.command == "bench":
            geometry = load_geometry(args.model)
            for tp in (args.prefill_tp, args.decode_tp):
                geometry.check_tp(tp)
                assert gpus >= tp, f"{line.label}: {gpus} GPU(s) for TP {tp}"


def test_multi_node_ranks_cover_each_group(objects):
    """Within a LeaderWorkerSet group the node ranks are 0..nnodes-1, leader first."""
    ranks: dict[str, list[int]] = {}
    for line, args in _parsed(objects):
        if args.command == "serve" and line.pod.owner["kind"] == "LeaderWorkerSet":
            assert args.nnodes == line.pod.owner["spec"]["leaderWorkerTemplate"]["size"]
            assert (args.node_rank == 0) == line.pod.name.endswith(" leader"), line.label
            ranks.setdefault(line.pod.owner["metadata"]["name"], []).append(args.node_rank)
    for name, seen in ranks.items():
        assert sorted(seen) == list(range(len(seen))), (name, seen)


def _bench_sides(name: str) -> list[int]:
    lines = [
        line for line in command_lines(rendered(name)) if line.argv[1:3] == ("bench", "transfer")
    ]
    return sorted(parse_pdxfer(line.argv).node_rank for line in lines)


def test_bench_job_runs_both_sides():
    """The bench overlay runs exactly the two sides, and no other overlay runs a side."""
    assert _bench_sides("bench") == [0, 1]
    for name in kustomizations():
        if name != "bench":
            assert _bench_sides(name) == [], name


def test_shell_scripts_are_valid_sh(objects):
    """The Jobs that are not pdxfer (smoke, model-fill) run one `sh -c` script each."""
    for line in command_lines(objects):
        if line.argv[:1] != ("pdxfer",) and not is_vllm(line):
            assert is_shell(line), f"{line.label}: neither pdxfer, vLLM nor sh -c SCRIPT"
            subprocess.run(["sh", "-n", "-c", line.argv[2]], check=True, timeout=30)


def test_workers_are_sized_from_the_config(objects):
    """--gpu-mem, --max-num-seqs and --max-num-batched-tokens come from the ConfigMap, and
    the values parse."""
    for line, args in _parsed(objects):
        if args.command != "serve" or args.role == "router":
            continue
        flags = line.container["args"]
        assert "--gpu-mem=$(PDXFER_GPU_MEM)" in flags, line.label
        assert "--max-num-seqs=$(PDXFER_MAX_NUM_SEQS)" in flags, line.label
        assert "--max-num-batched-tokens=$(PDXFER_MAX_NUM_BATCHED_TOKENS)" in flags, line.label
        assert "--staging-mib=$(PDXFER_STAGING_MIB)" in flags, line.label
        assert parse_size(args.gpu_mem, "--gpu-mem") >= 1 << 30, line.label
        assert args.max_seqs >= 1 and args.max_num_batched_tokens >= 1, line.label
