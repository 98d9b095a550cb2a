"""`pdxfer launch`: router + one prefill + one decode instance on localhost, N requests at once.

Prints a per-request table (or `--json`, a public interface) and, with `--verify`, checks
every request two ways: the decode ranks' caches right after the transfer equal the prefill
caches re-sliced by the geometry's shard functions, and the greedy tokens equal a colocated
TP=1 run. Exits 1 when a request fails or fails verification.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from transfer.cli.plan import add_model_arguments


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run router, prefill and decode locally and send requests",
        description="Start a router, one prefill and one decode instance as separate processes "
        "on localhost, send N requests at once, print TTFT, transfer time, bytes, descriptors "
        "and tokens/s per request, and shut everything down (Ctrl-C included).",
    )
    add_model_arguments(parser)
    parser.add_argument("--prefill-tp", type=int, default=1, help="prefill TP ranks (default 1)")
    parser.add_argument("--decode-tp", type=int, default=1, help="decode TP ranks (default 1)")
    parser.add_argument(
        "--transport", choices=["nixl", "ucx"], default="nixl", help="data plane (default nixl)"
    )
    parser.add_argument("--requests", type=int, default=4, help="requests sent at once (default 4)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="tokens generated per request (default 16)"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check caches bit for bit after each transfer and tokens against a TP=1 run",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (a public interface)")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default 0)")
    parser.add_argument("--gpu-mem", default="64MiB", help="cache memory per rank (default 64MiB)")
    parser.add_argument("--block-size", type=int, default=16, help="min KV block size (default 16)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(default cpu)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds for startup and for the requests"
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the run directory (logs, cache dumps)"
    )
    parser.set_defaults(func=run)


@dataclass
class Outcome:
    """What one request came back with (filled by its thread)."""

    request_id: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    ttft_ms: float = 0.0
    transfer_ms: float = 0.0
    kv_bytes: int = 0
    state_bytes: int = 0
    descriptors: int = 0
    wall_s: float = 0.0
    error: str = ""
    problems: list[str] = field(default_factory=list)
    done: bool = False

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ok(self) -> bool:
        return not self.error and not self.problems


def _check_args(args: argparse.Namespace) -> None:
    for name in ("prefill_tp", "decode_tp", "requests", "prompt_len", "max_tokens", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    return [
        [rng.randrange(vocab) for _ in range(length)]
        for rng in (random.Random(f"pdxfer-launch:{seed}:{i}") for i in range(n))
    ]


def run(args: argparse.Namespace) -> int:
    from transfer.engine.workers.instance import InstanceConfig, plan_for
    from transfer.engine.workers.procs import LAUNCH_ID_ENV, start_serve, stop_all, wait_ready
    from transfer.presets import load_geometry
    from transfer.units import parse_size

    _check_args(args)
    if args.model is None and args.hf_config is None:
        args.model = "tiny-qwen3-next"
    geometry = load_geometry(args.model, args.hf_config)
    budget = parse_size(args.gpu_mem, "--gpu-mem")
    for role, tp in (("prefill", args.prefill_tp), ("decode", args.decode_tp)):
        try:  # what each serve process will plan, checked before anything starts
            sizes = {"max_seqs": args.requests, "min_block_size": args.block_size}
            plan_for(InstanceConfig(role, geometry, tp, budget_bytes=budget, **sizes))
        except ValueError as exc:
            raise ValueError(f"--{role}-tp {tp}: {exc}") from None
    run_dir = Path(tempfile.mkdtemp(prefix="pdxfer-launch-"))
    dump_dir = run_dir / "caches" if args.verify else None
    model_args = ["--model", args.model] if args.model else ["--hf-config", args.hf_config]
    common = [
        "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", *model_args,
        "--transport", args.transport, "--gpu-mem", args.gpu_mem, "--device", args.device,
        "--max-seqs", str(args.requests), "--block-size", str(args.block_size),
        "--seed", str(args.seed),
        *(["--dump-dir", str(dump_dir)] if dump_dir else []),
    ]  # fmt: skip
    token = uuid.uuid4().hex
    # Every child carries the run's id in its environment: tests find leftovers by it.
    env = {
        LAUNCH_ID_ENV: os.environ.get(LAUNCH_ID_ENV) or uuid.uuid4().hex,
        "PDXFER_AUTH_TOKEN": token,
    }
    procs = []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    ok = False
    try:
        say = _Progress()
        say.line(
            f"starting prefill (tp {args.prefill_tp}) and decode (tp {args.decode_tp}) "
            f"with {args.transport}; logs in {run_dir}"
        )
        workers = [
            start_serve(
                role, [*common, "--tp", str(tp), "--instance-id", f"{role}-0"], run_dir, env
            )
            for role, tp in (("prefill", args.prefill_tp), ("decode", args.decode_tp))
        ]
        procs += workers
        prompts = _prompts(args.requests, args.prompt_len, geometry.vocab_size, args.seed)
        if args.verify:
            references = _References(geometry, prompts, args.max_tokens, args.seed)
        wait_ready(workers, args.timeout)
        router_args = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                       "--prefill", workers[0].address, "--decode", workers[1].address]  # fmt: skip
        procs.append(start_serve("router", router_args, run_dir, env))
        wait_ready(procs[-1:], args.timeout)
        say.line(f"router at {procs[-1].address}; sending {args.requests} requests")
        outcomes = _send_all(procs[-1].address, token, prompts, args, say)
        if args.verify:
            say.line("verifying")
            _verify(geometry, outcomes, references.get(args.timeout), dump_dir, args)
        ok = all(o.ok for o in outcomes)
        say.line("stopping workers")
    except RuntimeError as exc:  # a worker that would not start: its log tail is in the message
        print(f"launch: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_all(procs)
        if ok and not args.keep_logs:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            print(f"launch: run directory kept at {run_dir}", file=sys.stderr)
    summary = summarize(outcomes, args)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_table(outcomes, summary))
    return 0 if ok else 1


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


class _Progress:
    """Progress on stderr: one rewritten line on a terminal, changes only otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = ""

    def line(self, text: str) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")
        print(f"launch: {text}", file=sys.stderr, flush=True)
        self.last = ""

    def status(self, text: str) -> None:
        if text == self.last:
            return
        self.last = text
        if self.tty:
            sys.stderr.write(f"\rlaunch: {text}\033[K")
            sys.stderr.flush()
        else:
            print(f"launch: {text}", file=sys.stderr, flush=True)


def _send_all(address, token, prompts, args, say: _Progress) -> list[Outcome]:
    from transfer.control.client import RouterClient
    from transfer.control.types import GenerateRequest

    outcomes = [Outcome(f"req-{i:04d}", p) for i, p in enumerate(prompts)]
    client = RouterClient(address, token=token)

    def one(out: Outcome) -> None:
        start = time.perf_counter()
        try:
            request = GenerateRequest(out.request_id, tuple(out.prompt), args.max_tokens)
            for event in client.generate(request):
                if event.index == 0:
                    out.ttft_ms, out.transfer_ms = event.ttft_ms, event.transfer_ms
                    out.kv_bytes, out.state_bytes = event.kv_bytes, event.state_bytes
                    out.descriptors = event.descriptors
                out.tokens.append(event.token)
        except Exception as exc:  # a failed request is a row in the table, not a crash
            out.error = str(exc) or type(exc).__name__
        finally:
            out.wall_s = time.perf_counter() - start
            out.done = True

    threads = [threading.Thread(target=one, args=(o,), daemon=True) for o in outcomes]
    for t in threads:
        t.start()
    deadline = time.monotonic() + args.timeout
    try:
        while not all(o.done for o in outcomes):
            if time.monotonic() > deadline:
                for o in outcomes:
                    if not o.done:
                        o.error = f"no answer within --timeout {args.timeout:g}s"
                break
            done = sum(o.done for o in outcomes)
            failed = sum(bool(o.error) for o in outcomes)
            tokens = sum(len(o.tokens) for o in outcomes)
            say.status(f"{done}/{len(outcomes)} done, {failed} failed, {tokens} tokens streamed")
            time.sleep(0.1)
    finally:
        client.close()  # cancels whatever is still streaming
        for t in threads:
            t.join(timeout=5.0)
    say.status(
        f"{len(outcomes)}/{len(outcomes)} done, {sum(bool(o.error) for o in outcomes)} failed"
    )
    return outcomes


class _References:
    """The colocated TP=1 tokens of every prompt, computed on a thread while the workers
    start and serve (check 2 of --verify)."""

    def __init__(self, geometry, prompts: list[list[int]], max_tokens: int, seed: int) -> None:
        self.tokens: list[list[int]] = []
        self.error: BaseException | None = None
        self._args = (geometry, prompts, max_tokens, seed)
        self._thread = threading.Thread(target=self._run, name="pdxfer-reference", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import torch

            from transfer.engine.reference import reference_generate

            if "OMP_NUM_THREADS" not in os.environ:
                torch.set_num_threads(1)  # a tiny model; more threads only fight the workers
            geometry, prompts, max_tokens, seed = self._args
            self.tokens = [reference_generate(geometry, p, max_tokens, seed) for p in prompts]
        except BaseException as exc:
            self.error = exc

    def get(self, timeout_s: float) -> list[list[int]]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the TP=1 reference run took over {timeout_s:g}s")
        if self.error is not None:
            raise RuntimeError(f"the TP=1 reference run failed: {self.error}") from self.error
        return self.tokens


def _verify(geometry, outcomes: list[Outcome], references: list[list[int]], dump_dir, args) -> None:
    from transfer.engine.verify import check_request, tokens_check

    for out, expected in zip(outcomes, references, strict=True):
        if out.error:
            continue
        check = check_request(geometry, dump_dir, out.request_id, args.prefill_tp, args.decode_tp)
        out.problems += check.problems
        problem = tokens_check(expected, out.tokens)
        if problem:
            out.problems.append(problem)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return round(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), 3)

    return {"p50": pick(0.5), "p99": pick(0.99)}


def summarize(outcomes: list[Outcome], args: argparse.Namespace) -> dict:
    """The `--json` document. Byte and descriptor counts are totals over the requests."""
    good = [o for o in outcomes if not o.error]
    return {
        "model": args.model or args.hf_config,
        "transport": args.transport,
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "requests": len(outcomes),
        "verify": bool(args.verify),
        "verified": sum(o.ok for o in outcomes) if args.verify else 0,
        "failed": sum(not o.ok for o in outcomes),
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "kv_bytes": sum(o.kv_bytes for o in good),
        "state_bytes": sum(o.state_bytes for o in good),
        "descriptors": sum(o.descriptors for o in good),
        "ttft_ms": _percentiles([o.ttft_ms for o in good]),
        "transfer_ms": _percentiles([o.transfer_ms for o in good]),
        "tokens_per_s": _percentiles([o.tokens_per_s for o in good]),
        "per_request": [
            {
                "request_id": o.request_id,
                "tokens": len(o.tokens),
                "ttft_ms": round(o.ttft_ms, 3),
                "transfer_ms": round(o.transfer_ms, 3),
                "kv_bytes": o.kv_bytes,
                "state_bytes": o.state_bytes,
                "descriptors": o.descriptors,
                "tokens_per_s": round(o.tokens_per_s, 2),
                "error": o.error,
                "problems": o.problems,
            }
            for o in outcomes
        ],
    }


def format_table(outcomes: list[Outcome], summary: dict) -> str:
    header = ("request", "tokens", "ttft ms", "xfer ms", "kv bytes", "state bytes", "descr", "tok/s", "check")  # fmt: skip
    rows = []
    for o in outcomes:
        check = "-" if not summary["verify"] else ("ok" if o.ok else "FAIL")
        if o.error:
            check = "ERROR"
        rows.append((o.request_id, str(len(o.tokens)), f"{o.ttft_ms:.1f}", f"{o.transfer_ms:.2f}",
                     str(o.kv_bytes), str(o.state_bytes), str(o.descriptors),
                     f"{o.tokens_per_s:.1f}", check))  # fmt: skip
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in (header, *rows)]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    s = summary
    lines.append(
        f"\n{s['requests']} requests, {s['failed']} failed"
        + (f", {s['verified']} verified" if s["verify"] else "")
        + f" | {s['transport']} P={s['prefill_tp']} D={s['decode_tp']}"
        + f" | ttft p50 {s['ttft_ms']['p50']:.1f} ms p99 {s['ttft_ms']['p99']:.1f} ms"
        + f" | transfer p50 {s['transfer_ms']['p50']:.2f} ms p99 {s['transfer_ms']['p99']:.2f} ms"
    )
    for o in outcomes:
        for problem in ([o.error] if o.error else []) + o.problems:
            lines.append(f"{o.request_id}: {problem}")
    return "\n".join(lines)
