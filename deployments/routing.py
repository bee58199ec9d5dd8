"""Group affinity: the requests of one prompt group go to one replica (a Serve request router).

A prompt group is the requests of one prompt (its token ids per encoder): a GRPO group sent as
several requests, the same prompt again next epoch, its null prompt. Routed together, they batch
in one replica's engine loop (one forward for the group's rows) and hit one encoder replica's
prompt-embedding cache, where random routing spreads them over every replica.

Policy: rendezvous (highest-random-weight) hashing ranks the replicas for the group's key, so
every caller (each ingress replica, each process) ranks them alike without sharing state, and a
replica that joins or leaves moves only the groups it ranks first. The group's first replica
takes its requests while it has room; one the router knows to be full (its cached queue length
at `max_ongoing_requests`) passes the request to the next in the group's order. A replica whose
queue length is unknown or slow to probe counts as having room: it is waited for, never skipped,
so a loaded machine does not scatter a group. Calls without a prompt (version
loads, sleep, health) go to the least loaded replica. The cost: with few groups, replicas can be
unevenly loaded (hashing balances in expectation, not per step).
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from contract import PromptBundle, RolloutRequest


def group_key(prompt: PromptBundle) -> bytes:
    """A digest of the prompt's token ids per encoder: equal for the requests of one group."""
    ids = (prompt.token_ids, tuple(sorted(prompt.encoder_token_ids.items())),
           prompt.attention_mask)
    return hashlib.blake2b(repr(ids).encode(), digest_size=16).digest()


def request_group(args: Sequence[Any]) -> bytes | None:
    """The group key of a stage call: `rollout(request, ...)` or `encode([prompt, ...])` (a
    call's first prompt); None for calls that carry no prompt."""
    first = args[0] if args else None
    if isinstance(first, RolloutRequest):
        return group_key(first.prompt)
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], PromptBundle):
        return group_key(first[0])
    return None


def rendezvous_order(key: bytes, replica_ids: Sequence[str]) -> list[str]:
    """Replica ids by descending weight hash(key, id): the group's order of preference."""
    def weight(replica_id: str) -> bytes:
        return hashlib.blake2b(key + replica_id.encode(), digest_size=8).digest()
    return sorted(replica_ids, key=weight, reverse=True)


class GroupAffinityRouter(RequestRouter):
    """Serve request router: a group's call to the first replica in its rendezvous order that
    is not known to be full (Serve probes it and backs off until it takes the call)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Serve retries a full replica at once unless told to back off: without this the
            # process's one router thread spins and starves every other deployment's probes.
            pending_request.routing_context.should_backoff = True
        key = None if pending_request is None else request_group(pending_request.args)
        if key is None:
            return [list(candidate_replicas)]          # the least loaded of them all
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ordered = [by_id[i] for i in rendezvous_order(key, list(by_id))]
        room = {r.replica_id for r in self.select_available_replicas(ordered)}
        return [[next((r for r in ordered if r.replica_id in room), ordered[0])]]
