"""`pdxfer up --engine vllm`: a vLLM prefill server and a vLLM decode server with a KV connector
(PdxferConnector by default), pdxfer's router in front as the OpenAI API, until Ctrl-C or
SIGTERM; then every process is stopped."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from transfer.cli.vllm_args import kv_cache_bytes, vllm_model_dir, vllm_python
from transfer.errors import InvalidInput

WATCH_INTERVAL_S = 0.5


def run_vllm_up(args: argparse.Namespace) -> int:
    from transfer.serving.launch.procs import start_serve, stop_all, wait_ready
    from transfer.serving.launch.vllm_servers import Connector
    from transfer.serving.launch.vllm_stack import VllmPdPlan, running_vllm_pd

    for flag in ("prefill_instances", "decode_instances"):
        if getattr(args, flag) != 1:
            raise InvalidInput(f"--{flag.replace('_', '-')}: --engine vllm starts one prefill "
                               "and one decode server")  # fmt: skip
    for flag in ("prefill_tp", "decode_tp"):
        if getattr(args, flag) < 1:
            raise InvalidInput(f"--{flag.replace('_', '-')} must be >= 1")
    plan = VllmPdPlan(
        model=vllm_model_dir(args.model),
        connector=Connector(args.connector),
        python=vllm_python(args.vllm_python),
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        host=args.host,
        max_model_len=args.vllm_max_model_len,
        kv_cache_bytes=kv_cache_bytes(args.vllm_kv_cache),
    )
    run_dir = Path(tempfile.mkdtemp(prefix="pdxfer-up-vllm-"))
    keep, router = False, None
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        _say(f"starting vLLM prefill (tp {plan.prefill_tp}) and decode (tp {plan.decode_tp}) "
             f"with the {plan.connector.value} connector ({plan.python}); logs in {run_dir}")  # fmt: skip
        with running_vllm_pd(plan, run_dir, args.timeout) as (prefill, decode):
            flags = [
                "--engine", "vllm", "--host", args.host, "--model", str(plan.model),
                "--prefill", prefill.url, "--decode", decode.url,
                # 0: the router binds a free port itself; one picked before the vLLM servers
                # started could be taken by one of their sockets by now.
                "--http-port", str(args.http_port or 0),
                "--max-model-len", str(plan.max_model_len),
                *(["--served-model-name", args.served_model_name] if args.served_model_name else []),
                *(["--api-key-file", args.api_key_file] if args.api_key_file else []),
                *(["--insecure"] if args.insecure else []),
            ]  # fmt: skip
            router = start_serve("router", flags, run_dir / "router")
            wait_ready([router], args.timeout)
            base = f"http://{router.address}"  # its ready line names the port it bound
            for server in (prefill, decode):
                print(f"{server.spec.name:8s} vLLM {server.url} (tp {server.spec.tp})  "
                      f"metrics {server.url}/metrics", flush=True)  # fmt: skip
            print(f"router   {base} (pdxfer, vLLM's two-step P/D protocol)", flush=True)
            print(f"OpenAI API at {base}/v1 (health {base}/health); Ctrl-C to stop", flush=True)
            _watch(router, prefill, decode)
    except KeyboardInterrupt:
        _say("stopping")
    except RuntimeError as exc:  # a process that would not start or died: its log tail
        keep = True
        print(f"pdxfer up: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        if router is not None:
            stop_all([router])
        if keep:
            print(f"pdxfer up: logs kept in {run_dir}", file=sys.stderr)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _watch(router, *servers) -> None:
    """Serve until interrupted; RuntimeError when a process exits on its own."""
    while True:
        if router.popen.poll() is not None:
            raise RuntimeError(f"the router exited with code {router.popen.returncode}:\n"
                               f"{router.log_tail()}")  # fmt: skip
        for server in servers:
            if server.popen.poll() is not None:
                raise RuntimeError(
                    f"vLLM {server.spec.name} exited with code {server.popen.returncode}:\n"
                    f"{server.log_tail()}"
                )
        time.sleep(WATCH_INTERVAL_S)


def _say(text: str) -> None:
    print(f"pdxfer up: {text}", file=sys.stderr, flush=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt
