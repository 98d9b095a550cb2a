"""Two network-namespace "nodes" joined by a veth pair, for benchmarks that must cross a
real network stack on one box. Needs root and iproute2; always cleans up."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

# A private /30 that exists only inside the two namespaces we create.
DEFAULT_SUBNET = "10.203.0"


@dataclass(frozen=True)
class Node:
    namespace: str
    address: str
    device: str  # this node's end of the veth pair, e.g. for UCX_NET_DEVICES

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def check_can_create() -> None:
    """Raise RuntimeError saying what is missing when namespaces cannot be made."""
    if os.geteuid() != 0:
        raise RuntimeError(
            "--nodes netns needs root (it creates network namespaces and a veth pair); "
            "rerun as root or use --nodes loopback"
        )
    if shutil.which("ip") is None:
        raise RuntimeError("--nodes netns needs iproute2's `ip` (apt-get install iproute2)")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


class TwoNodes:
    """Context manager: `with TwoNodes() as (prefill_node, decode_node): ...`.

    Creates namespaces `pdx-<id>-p` and `pdx-<id>-d`, a veth pair between them with
    addresses `<subnet>.1` and `<subnet>.2`, and removes both namespaces on exit — also on
    errors and at interpreter exit if the context was never left.
    """

    def __init__(self, subnet: str = DEFAULT_SUBNET, mtu: int = 9000) -> None:
        tag = uuid.uuid4().hex[:6]
        self.prefill = Node(f"pdx-{tag}-p", f"{subnet}.1", f"pdx-{tag}-p0")
        self.decode = Node(f"pdx-{tag}-d", f"{subnet}.2", f"pdx-{tag}-d0")
        self.mtu = mtu
        self._created: list[str] = []

    def __enter__(self) -> tuple[Node, Node]:
        check_can_create()
        atexit.register(self.remove)
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self.prefill, self.decode

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def _create(self) -> None:
        veth_p, veth_d = self.prefill.device, self.decode.device
        for node in (self.prefill, self.decode):
            _ip("netns", "add", node.namespace)
            self._created.append(node.namespace)
        _ip("link", "add", veth_p, "type", "veth", "peer", "name", veth_d)
        for node, veth in ((self.prefill, veth_p), (self.decode, veth_d)):
            _ip("link", "set", veth, "netns", node.namespace)
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/30", "dev", veth)
            _ip("-n", node.namespace, "link", "set", veth, "mtu", str(self.mtu), "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")

    def remove(self) -> None:
        """Delete every namespace this object created (their veth ends go with them)."""
        while self._created:
            namespace = self._created.pop()
            subprocess.run(
                ["ip", "netns", "delete", namespace], capture_output=True, timeout=30, check=False
            )
        atexit.unregister(self.remove)
