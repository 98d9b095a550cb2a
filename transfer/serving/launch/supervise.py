"""Keep `pdxfer up`'s prefill and decode instances running.

An instance that exits is started again on its old address (the router knows it by that
address and notices it is back: a decode instance that lost its registrations answers
PERMISSION_DENIED, which the router meets by registering again). Restarts back off:
`first_backoff_s` after a death, doubling per death in a row up to `max_backoff_s`. Deaths
"in a row" are those of an instance that did not stay up `stable_s`; after `max_restarts`
restarts in a row the instance is given up. Meanwhile the router serves the instances left;
`up` ends only when a role has no instance left or the router itself dies.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from transfer.serving.launch.procs import ServeProcess, start_serve, stop_all, wait_ready
from transfer.serving.role import INSTANCE_ROLES, ServeRole

WATCH_INTERVAL_S = 0.5


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead instance is started again, and when it is given up."""

    max_restarts: int = 5
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {self.max_restarts}")

    def backoff_s(self, deaths_in_a_row: int) -> float:
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** max(0, deaths_in_a_row - 1))

    def describe(self) -> str:
        return (
            f"a prefill or decode instance that exits is started again on its address after "
            f"{self.first_backoff_s:g}s, doubling per death in a row up to "
            f"{self.max_backoff_s:g}s; after N restarts in a row (none staying up "
            f"{self.stable_s:g}s) it is given up, and `up` exits 1 once a role has no "
            f"instance left; 0: never restart"
        )


class State(enum.Enum):
    RUNNING = "running"  # printed its READY line
    STARTING = "starting"  # restarted, READY line not yet seen
    WAITING = "waiting"  # dead, restart due at `due`
    GIVEN_UP = "given up"


@dataclass
class Instance:
    """One supervised `pdxfer serve ROLE`; `flags` are its serve flags without --port."""

    role: ServeRole
    name: str
    flags: list[str]
    proc: ServeProcess
    state: State = State.STARTING
    port: int = 0
    up_since: float = 0.0
    deaths_in_a_row: int = 0
    restarts: int = 0
    due: float = 0.0
    started_at: float = 0.0


class SupervisorMetrics:
    """`up`'s own registry: restarts per role and instances serving per role."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.restarts = Counter(
            "pdxfer_up_restarts", "Instances started again after they exited", ["role"],
            registry=self.registry,
        )  # fmt: skip
        self.serving = Gauge(
            "pdxfer_up_instances_running", "Instances that are up (READY)", ["role"],
            registry=self.registry,
        )  # fmt: skip
        for role in INSTANCE_ROLES:
            self.restarts.labels(role=role)
            self.serving.labels(role=role)


class Supervisor:
    """Starts the instances, restarts dead ones by `policy`, stops them all (`stop`)."""

    def __init__(
        self,
        run_dir: Path,
        env: dict[str, str],
        policy: RestartPolicy,
        say: Callable[[str], None],
        start_timeout_s: float = 300.0,
        metrics: SupervisorMetrics | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.start_timeout_s = start_timeout_s
        self.env = env
        self.policy = policy
        self.say = say
        self.metrics = metrics or SupervisorMetrics()
        self.instances: list[Instance] = []
        self._metrics_server = None

    def serve_metrics(self, host: str) -> int:
        """Serve the restart counters at http://HOST:PORT/metrics; the port it bound."""
        from prometheus_client import start_http_server

        self._metrics_server, _ = start_http_server(0, addr=host, registry=self.metrics.registry)
        return self._metrics_server.server_port

    def start(self, role: ServeRole, name: str, flags: list[str]) -> Instance:
        """Start an instance on a free port (wait for it with `wait_ready`)."""
        proc = start_serve(role, [*flags, "--port", "0"], self.run_dir / name, self.env)
        instance = Instance(role, name, list(flags), proc, started_at=time.monotonic())
        self.instances.append(instance)
        return instance

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for every instance started so far; RuntimeError names one that is not."""
        wait_ready([i.proc for i in self.instances], timeout_s)
        for instance in self.instances:
            self._running(instance, time.monotonic())

    @property
    def processes(self) -> list[ServeProcess]:
        """The processes started and not yet found dead."""
        live = (State.RUNNING, State.STARTING)
        return [i.proc for i in self.instances if i.state in live]

    def watch(self, router: ServeProcess) -> None:
        """Supervise until interrupted; RuntimeError when the router exits or a role has
        no instance left."""
        while True:
            code = router.popen.poll()
            if code is not None:
                raise RuntimeError(f"serve router exited with code {code}:\n{router.log_tail()}")
            self.check(time.monotonic())
            time.sleep(WATCH_INTERVAL_S)

    def check(self, now: float) -> None:
        """One pass over the instances: notice deaths, start due restarts, see READY lines."""
        for instance in self.instances:
            if instance.state is State.RUNNING:
                code = instance.proc.popen.poll()
                if code is not None:
                    self._died(instance, now, f"exited with code {code}")
            elif instance.state is State.STARTING:
                try:
                    if instance.proc.poll_ready():
                        self._running(instance, now)
                        self.say(f"{instance.name} is back at {instance.proc.address} "
                                 f"(pid {instance.proc.pid})")  # fmt: skip
                    elif now - instance.started_at > self.start_timeout_s:
                        limit = self.start_timeout_s
                        self._died(instance, now, f"was not ready within {limit:g}s")
                except RuntimeError:
                    code = instance.proc.popen.poll()
                    self._died(instance, now, f"exited with code {code} before it was ready")
            elif instance.state is State.WAITING and now >= instance.due:
                self._restart(instance)
        for role in INSTANCE_ROLES:
            members = [i for i in self.instances if i.role == role]
            running = sum(i.state is State.RUNNING for i in members)
            self.metrics.serving.labels(role=role).set(running)
            if members and all(i.state is State.GIVEN_UP for i in members):
                raise RuntimeError(f"every {role} instance was given up; see its log above")

    def stop(self, others: Sequence[ServeProcess] = ()) -> None:
        """Stop every instance and `others` (all at once), and the metrics server."""
        stop_all([*self.processes, *others])
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()

    def _running(self, instance: Instance, now: float) -> None:
        instance.state = State.RUNNING
        instance.up_since = now
        if not instance.port:
            instance.port = int(instance.proc.address.rpartition(":")[2])

    def _died(self, instance: Instance, now: float, how: str) -> None:
        if instance.state is State.RUNNING and now - instance.up_since >= self.policy.stable_s:
            instance.deaths_in_a_row = 0
        instance.deaths_in_a_row += 1
        log = instance.proc.stderr_path
        # Its rank processes may outlive it briefly: end its whole group now.
        stop_all([instance.proc], grace_s=0.0)
        if instance.deaths_in_a_row > self.policy.max_restarts:
            instance.state = State.GIVEN_UP
            self.say(f"{instance.name} (pid {instance.proc.pid}) {how}; given up after "
                     f"{instance.restarts} restarts (log {log}):\n"
                     f"{instance.proc.log_tail()}")  # fmt: skip
            return
        instance.state = State.WAITING
        delay = self.policy.backoff_s(instance.deaths_in_a_row)
        instance.due = now + delay
        self.say(f"{instance.name} (pid {instance.proc.pid}) {how}; restarting it in "
                 f"{delay:g}s on port {instance.port} (log {log})")  # fmt: skip

    def _restart(self, instance: Instance) -> None:
        instance.restarts += 1
        log_dir = self.run_dir / instance.name / f"restart-{instance.restarts}"
        flags = [*instance.flags, "--port", str(instance.port)]
        instance.proc = start_serve(instance.role, flags, log_dir, self.env)
        instance.state = State.STARTING
        instance.started_at = time.monotonic()
        self.metrics.restarts.labels(role=instance.role).inc()
        self.say(f"{instance.name}: restart {instance.restarts} (pid {instance.proc.pid})")
