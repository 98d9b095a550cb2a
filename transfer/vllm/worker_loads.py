"""Decode's loads in flight on one worker rank.

Each step's loads are planned (`load_reads`) against the prefill ranks' layouts -- known from
the scheduler half's handshake with each prefill instance, sent along with the first load that
reads it, so a worker never calls the control plane -- and posted through the
`TransferAgent`. Once all its reads settled, a load's staged pieces are copied into place and
checked (verify), and it is reported finished or failed. A load finishes -- and its failure
is reported -- only once nothing of it can still land.
"""

from __future__ import annotations

import json
import logging
import time

from transfer.agent import Finished, PeerReads, TransferAgent
from transfer.cache.explicit_layout import ExplicitLayout
from transfer.errors import InvalidInput
from transfer.vllm.load_reads import DigestTables, LoadPlanner, PrefillRanks, tables_key
from transfer.vllm.metadata import LoadSpec, PrefillPeer
from transfer.vllm.region_copies import Columns, RegionCopies
from transfer.vllm.stats import PdxferStats
from transfer.vllm.worker_verify import RankVerifier

logger = logging.getLogger(__name__)


class DecodeLoads:
    """The rank's loads from posting until vLLM is told they finished or failed."""

    def __init__(
        self,
        agent: TransferAgent,
        planner: LoadPlanner,
        copies: RegionCopies,
        verifier: RankVerifier,
        *,
        verify: bool,
        stats: PdxferStats,
    ) -> None:
        self._agent = agent
        self._planner = planner
        self._copies = copies
        self._verifier = verifier
        self._verify = verify
        self._stats = stats
        self._peers: dict[str, PrefillRanks] = {}
        self._loads: dict[str, LoadSpec] = {}
        self._landing: dict[str, Columns] = {}  # request -> staging -> cache copies, once landed
        self._verifying: dict[str, DigestTables] = {}
        self._unverified_peers: set[str] = set()
        self._stuck_logged: set[str] = set()  # loads failed but not settled, logged once
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._error_blocks: set[int] = set()

    def start(self, peers: dict[str, PrefillPeer], loads: list[LoadSpec]) -> None:
        """Learn the step's new prefill instances, then post its loads."""
        for address, peer in peers.items():
            self._connect(address, peer)
        for load in loads:
            try:
                peer = self._peer(load.ticket.control_address)
                reads, copies = self._planner.cache_reads(load, peer)
                reads = [*reads, *self._table_reads(load, peer)]
            except Exception as exc:  # the load fails, vLLM recomputes; the server lives
                logger.warning(
                    "pdxfer: load of %s from %s failed before posting: %s",
                    load.request_id,
                    load.ticket.control_address,
                    exc,
                )
                self._unstage(load.request_id)
                self._verifying.pop(load.request_id, None)
                self._fail(load)
                continue
            self._loads[load.request_id] = load
            if copies is not None:
                self._landing[load.request_id] = copies
            self._agent.post(load.request_id, reads)

    def poll(self) -> None:
        """Settle every load whose reads all finished."""
        for done in self._agent.poll():
            self._finish(done)
            self._stuck_logged.discard(done.key)
        self._log_unsettled()

    def take_done(self) -> tuple[set[str], set[str]]:
        """The loads finished and those failed since the last call."""
        finished, self._finished = self._finished, set()
        failed, self._failed = self._failed, set()
        return finished, failed

    def take_error_blocks(self) -> set[int]:
        errors, self._error_blocks = self._error_blocks, set()
        return errors

    def _table_reads(self, load: LoadSpec, peer: PrefillRanks) -> list[PeerReads]:
        """Verify: the prefill ranks' digest tables of the request, read with the load."""
        if not self._verify:
            return []
        address = load.ticket.control_address
        if not load.ticket.digest_offsets:
            if address not in self._unverified_peers:
                self._unverified_peers.add(address)
                logger.warning("pdxfer verify: %s publishes no digests (verify off there); "
                               "its loads go unchecked", address)  # fmt: skip
            return []
        reads, tables = self._planner.table_reads(load, peer)
        self._verifying[load.request_id] = tables
        return reads

    def _log_unsettled(self) -> None:
        """Name, once, each load that failed (its deadline passed, say) while the transport
        cannot yet vouch that none of its bytes still land: vLLM keeps its blocks till then."""
        for key in self._loads.keys() - self._stuck_logged:
            failure = self._agent.failure(key)
            if failure:
                self._stuck_logged.add(key)
                logger.warning(
                    "pdxfer: load of %s failed (%s); its blocks stay held until the transport "
                    "settles it",
                    key,
                    failure,
                )

    def _finish(self, done: Finished) -> None:
        """A load whose reads all settled: its staged pieces into place, its check (verify),
        then finished or failed."""
        load = self._loads.pop(done.key)
        landing = self._landing.pop(done.key, None)
        tables = self._verifying.pop(done.key, None)
        error, seconds = done.error, done.seconds
        if not error:
            started = time.perf_counter()
            try:
                if landing is not None:
                    self._copies.copy(*landing)
                seconds += time.perf_counter() - started
                problems = self._check(load, tables) if tables is not None else []
            except Exception as exc:
                error = f"after landing: {exc}"
            else:
                if problems:
                    self._stats.record_verify_failure()
                    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
                    error = "verify: " + "; ".join(problems[:3]) + more
        self._unstage(done.key)
        if error:
            logger.warning("pdxfer: load of %s failed: %s", done.key, error)
            self._fail(load)
            return
        self._stats.record_transfer(done.nbytes, done.descriptors, seconds)
        self._finished.add(done.key)

    def _check(self, load: LoadSpec, tables: DigestTables) -> list[str]:
        landed = [self._planner.staging.read(at, n) for at, n in tables.landed]
        return self._verifier.check(load, tables.layouts, landed)

    def _unstage(self, request_id: str) -> None:
        self._planner.staging.free(request_id, tables_key(request_id))

    def _fail(self, load: LoadSpec) -> None:
        self._stats.record_failed_transfer()
        self._failed.add(load.request_id)
        # vLLM takes block-level load errors only with one KV cache group; with several (any
        # hybrid model) the engine dies on them, and the request id in failed_recving is the
        # whole report.
        if len(self._planner.groups) == 1:
            for group in load.block_ids:
                self._error_blocks.update(group)

    def _connect(self, address: str, peer: PrefillPeer) -> None:
        """Learn a prefill instance from the scheduler's handshake with it (local calls only);
        if that fails, its loads fail (vLLM recomputes) and the server lives."""
        self._peers.pop(address, None)
        started = time.monotonic()
        try:
            layouts = tuple(ExplicitLayout.from_dict(json.loads(raw)) for raw in peer.layouts)
            agents = tuple(self._agent.connect(m) for m in peer.agent_metadata)
        except Exception as exc:
            logger.warning("pdxfer: prefill %s (%s) unusable: %s", peer.instance_id, address, exc)
            return
        self._peers[address] = PrefillRanks(layouts, agents)
        # Once per prefill instance: a connect that takes seconds shows here (TP-2 hangs).
        logger.info(
            "pdxfer: rank %d connected to prefill %s (%d agents) in %.3f s",
            self._planner.rank,
            address,
            len(agents),
            time.monotonic() - started,
        )

    def _peer(self, address: str) -> PrefillRanks:
        peer = self._peers.get(address)
        if peer is None:
            raise InvalidInput(f"ticket.control_address: no usable handshake with {address}")
        return peer
