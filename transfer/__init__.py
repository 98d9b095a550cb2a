"""pdxfer: moves a request's KV blocks and S&Conv state from prefill to decode workers."""

import os

# gRPC's fork handlers restart its poller in a child forked for `subprocess.Popen`, and
# that child can abort on EBADF before it execs (grpc/grpc#43055). pdxfer forks only to
# exec (rank and serve processes), so it needs no fork support. The variable is read when
# `grpc` is first imported, hence here; an explicit setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
