"""Decode's checks of a pdxfer ticket: the one in a request's `kv_transfer_params` (parsed,
and ignored once its load was ordered), and -- once acquired -- against what prefill's
TicketStore holds, so a forged or stale ticket never reads another request's cache.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from transfer.control.types import Ticket as StoreTicket
from transfer.errors import InvalidInput
from transfer.vllm.scheduler_groups import TransferGroups
from transfer.vllm.ticket import PARAMS_KEY, Ticket

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

LOADED = "_pdxfer_loaded"  # set once the load is ordered: a rescheduled request loads nothing


def request_ticket(request: Request) -> Ticket | None:
    """The request's pdxfer ticket; None without one, once marked loaded, or when it does
    not parse (logged: vLLM then computes the prompt)."""
    params = request.kv_transfer_params
    if not params or PARAMS_KEY not in params or params.get(LOADED):
        return None
    try:
        return Ticket.from_params(params)
    except InvalidInput as exc:
        logger.warning("request %s: ignoring its pdxfer ticket: %s", request.request_id, exc)
        return None


def mark_loaded(request: Request) -> None:
    """The request's ticket is never tracked again (`request_ticket` returns None)."""
    request.kv_transfer_params[LOADED] = True


def mismatch(ticket: Ticket, held: StoreTicket, groups: TransferGroups) -> str | None:
    """How the client's ticket differs from the one prefill's TicketStore holds, or None.

    The store keeps the ticket group's block ids and the token count; the other groups' ids
    (a mamba group's state block) are not in it and cannot be checked here."""
    if ticket.num_tokens != held.num_tokens:
        return f"num_tokens {ticket.num_tokens}, prefill holds {held.num_tokens}"
    if len(ticket.block_ids) != len(groups):
        return f"{len(ticket.block_ids)} block groups, this model has {len(groups)}"
    ticket_group = groups.ticket_group
    if tuple(ticket.block_ids[ticket_group]) != tuple(held.block_ids):
        return (
            f"block_ids[{ticket_group}] {list(ticket.block_ids[ticket_group])}, "
            f"prefill holds {list(held.block_ids)}"
        )
    return None
