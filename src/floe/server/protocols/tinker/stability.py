"""Stability info: what a sampler records for `stable_reinforce` when a sample request sets
`record_stability_info = true`.

Tinker publishes neither what its sampler records nor the loss that reads it, so this is floe's
definition (docs/tinker.md, docs/losses.md): for every sampled sequence, its sampled tokens and
the per-token log-probs the server's sampler computed for them, keyed by the sequence's id (the
`sample_sequence_ids` asample returns, which the SDK hands out as `SampledSequence.sequence_id`).
A training datum names them in its provenance spans (`Datum.loss_fn_input_spans`), and
`stable_reinforce` takes its behaviour log-probs from the record instead of the client's copy.

Records are owned by the principal that sampled (one `Principal.may_change` rule: others'
sequence ids are unknown to a key), bounded per owner by `[server] tinker_max_stability_tokens`
(tokens recorded; the oldest records of that owner go first) and dropped with their session.
They live in memory only: a server restart forgets them (the next sample records anew).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from floe.server.principals import Principal

__all__ = ["SequenceRecord", "StabilityRecords", "missing_record_message"]

SETTING = "[server] tinker_max_stability_tokens"


@dataclass(frozen=True)
class SequenceRecord:
    """One sampled sequence as the sampler produced it: `tokens` (int64) and `logprobs`
    (float32, the sampler's log-prob of each token, at the request's temperature)."""

    owner: str
    session_id: str
    tokens: np.ndarray
    logprobs: np.ndarray

    @property
    def size(self) -> int:
        return int(self.tokens.size)


def missing_record_message(sequence_id: str, bound: int) -> str:
    return (
        f"no stability info for sequence {sequence_id[:120]!r}: stable_reinforce takes each sampled token's "
        "behaviour log-prob from what the server recorded when it sampled it, so sample with "
        "record_stability_info=True (save_weights_and_get_sampling_client(record_stability_info=True) or "
        "create_sampling_client(..., record_stability_info=True)) and train on those sequences. This server keeps "
        f"the last {bound} recorded tokens per key ({SETTING}); older records, those of finished sessions and all "
        "of them after a server restart are gone"
    )


class StabilityRecords:
    """Recorded sequences by id, at most `max_tokens` tokens per owner (thread-safe)."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._records: dict[str, SequenceRecord] = {}
        self._order: dict[str, OrderedDict[str, None]] = {}  # owner -> its sequence ids, oldest first
        self._tokens: dict[str, int] = {}  # owner -> tokens recorded

    def tokens_of(self, owner: str) -> int:
        with self._lock:
            return self._tokens.get(owner, 0)

    def put(self, owner: str, session_id: str, sequence_id: str, tokens: Sequence[int], logprobs: Sequence[float]) -> None:
        """Record one sequence (its tokens and the sampler's log-probs, one per token); the
        owner's oldest records leave until its total fits `max_tokens`. A sequence longer than
        the bound is not kept (the caller bounds requests before sampling)."""
        if len(tokens) != len(logprobs):
            raise ValueError("one log-prob per sampled token")
        record = SequenceRecord(owner, session_id, np.asarray(tokens, dtype=np.int64),
                                np.asarray(logprobs, dtype=np.float32))
        if record.size > self.max_tokens:
            return
        with self._lock:
            self._drop(sequence_id)
            order = self._order.setdefault(owner, OrderedDict())
            self._records[sequence_id] = record
            order[sequence_id] = None
            self._tokens[owner] = self._tokens.get(owner, 0) + record.size
            while self._tokens[owner] > self.max_tokens:
                self._drop(next(iter(order)))

    def get(self, who: Principal, sequence_id: str) -> SequenceRecord | None:
        """The record of `sequence_id` if `who` may use it (it sampled it); None otherwise."""
        with self._lock:
            record = self._records.get(sequence_id)
        if record is None or not who.may_change(record.owner):
            return None
        return record

    def drop_session(self, session_id: str) -> None:
        """Forget every record sampled in `session_id` (the session ended)."""
        with self._lock:
            for sid in [s for s, r in self._records.items() if r.session_id == session_id]:
                self._drop(sid)

    def _drop(self, sequence_id: str) -> None:
        record = self._records.pop(sequence_id, None)
        if record is None:
            return
        order = self._order[record.owner]
        order.pop(sequence_id, None)
        self._tokens[record.owner] -= record.size
        if not order:
            del self._order[record.owner], self._tokens[record.owner]
