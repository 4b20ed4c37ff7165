"""Framework batch layouts <-> `floe.Batch`: pure functions, no framework import.

RL frameworks hand their trainers padded tensors with one row per sample, the prompt copied
into every row; floe takes groups (one prompt, its samples; floe.types). The functions here
turn a framework's rows into groups (rows that share a prompt id and prompt tokens become one
group, so the policy computes that prompt once), remember where each row went, and put floe's
per-token results back into the framework's own alignment.

floe's alignment (floe.types): `Sample.logprobs[t]` = log p(tokens[t] | prompt, tokens[:t]);
weights, per-token advantages and reference log-probs are aligned the same way.

Each framework has its own section; a section only uses torch, floe.types and floe.errors.
Bad input raises floe.errors.InvalidInput naming the argument (and row) at fault.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from floe.errors import InvalidInput
from floe.types import Batch, Group, Sample

# -- shared helpers ---------------------------------------------------------------------------


@dataclass
class RowLayout:
    """A batch rebuilt from a framework's rows, and where each row went.

    batch:     the floe.Batch (groups in order of each group's first row; samples in row order)
    positions: positions[i] = (group index, sample index) of framework row i
    """

    batch: Batch
    positions: list[tuple[int, int]]

    def per_row(self, values: Sequence[Sequence[Any]]) -> list[Any]:
        """Values indexed [group][sample] (e.g. ForwardResult.logprobs) in framework row order."""
        return [values[g][s] for g, s in self.positions]


def unpad_rows(padded: torch.Tensor, lengths: Sequence[int], field: str = "tensor") -> list[list[Any]]:
    """The first lengths[i] entries of row i of a right-padded [B, W] tensor, as Python lists.

    InvalidInput(field) when the tensor is not 2-D, the row count differs from len(lengths),
    or a length is outside [0, W].
    """
    if not isinstance(padded, torch.Tensor) or padded.dim() != 2:
        raise InvalidInput(field, f"must be a 2-D tensor [rows, width], got {_describe(padded)}")
    if padded.shape[0] != len(lengths):
        raise InvalidInput(field, f"has {padded.shape[0]} rows but {len(lengths)} lengths were given")
    width = padded.shape[1]
    out = []
    for i, n in enumerate(lengths):
        if not 0 <= int(n) <= width:
            raise InvalidInput(f"{field}[{i}]", f"length {n} is outside [0, {width}]")
        out.append(padded[i, : int(n)].tolist())
    return out


def pad_rows(rows: Sequence[Sequence[float]], width: int | None = None, value: float = 0.0,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Right-pad rows of numbers into a [len(rows), width] tensor (width default: longest row).

    InvalidInput("width") when a row is longer than `width`.
    """
    longest = max((len(r) for r in rows), default=0)
    width = longest if width is None else width
    if longest > width:
        raise InvalidInput("width", f"a row has {longest} entries, more than width={width}")
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(list(r), dtype=dtype)
    return out


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _optional_rows(name: str, rows: Sequence[Sequence[float]] | None, lengths: list[int]) -> list[list[float]] | None:
    if rows is None:
        return None
    if len(rows) != len(lengths):
        raise InvalidInput(name, f"has {len(rows)} rows but the batch has {len(lengths)}")
    out = []
    for i, (row, n) in enumerate(zip(rows, lengths)):
        values = [float(v) for v in (row.tolist() if isinstance(row, torch.Tensor) else row)]
        if len(values) != n:
            raise InvalidInput(f"{name}[{i}]", f"has {len(values)} values but the response has {n} tokens")
        out.append(values)
    return out


def _token_rows(name: str, rows: Sequence[Sequence[int]]) -> list[list[int]]:
    out = []
    for i, row in enumerate(rows):
        tokens = row.tolist() if isinstance(row, torch.Tensor) else list(row)
        if not all(type(t) is int for t in tokens):
            raise InvalidInput(f"{name}[{i}]", "must hold integer token ids")
        out.append(tokens)
    return out


# -- verl --------------------------------------------------------------------------------------
#
# verl keeps one row per sample. Its V1 trainer stores jagged rows (`prompts`, `responses`,
# `input_ids` = prompt + response, `response_mask`, and per-token `old_log_probs`,
# `advantages`, `ref_log_prob` over the response); padded, `input_ids`/`attention_mask` are
# right-padded over prompt + response and `responses`/`response_mask` right-padded over the
# response. Rows of one prompt share the prompt's `uid`. Model outputs over the whole
# sequence (`log_probs`, `entropy`) put log p(token j+1) at position j, so response token t
# (sequence position P + t) has its log-prob at position P + t - 1; verl's
# `response_from_nested` reads them back from there.


def verl_to_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    uids: Sequence[Hashable],
    *,
    response_mask: Sequence[Sequence[float]] | None = None,
    old_log_probs: Sequence[Sequence[float]] | None = None,
    advantages: Sequence[Sequence[float]] | None = None,
    ref_log_probs: Sequence[Sequence[float]] | None = None,
) -> RowLayout:
    """verl's jagged rows -> a floe Batch with one group per (uid, prompt).

    prompts[i] / responses[i]: row i's prompt and response token ids (lists or 1-D tensors);
    uids[i]: the id verl gives every row of one prompt. Rows with the same uid and the same
    prompt tokens become one group (groups in order of first appearance, samples in row order).
    response_mask / old_log_probs / advantages / ref_log_probs: optional per-token rows over
    the response (len == len(responses[i])); they become Sample.weights / logprobs /
    advantage (per token) / ref_logprobs. Returns RowLayout(batch, positions).
    InvalidInput names the argument and row for mismatched counts or lengths, empty prompts
    or responses and non-integer tokens.
    """
    if not (len(prompts) == len(responses) == len(uids)):
        raise InvalidInput("uids", f"prompts ({len(prompts)}), responses ({len(responses)}) and uids ({len(uids)}) "
                           "must have one entry per row")
    if not prompts:
        raise InvalidInput("prompts", "must hold at least one row")
    prompt_rows = _token_rows("prompts", prompts)
    response_rows = _token_rows("responses", responses)
    for i, (p, r) in enumerate(zip(prompt_rows, response_rows)):
        if not p:
            raise InvalidInput(f"prompts[{i}]", "must not be empty")
        if not r:
            raise InvalidInput(f"responses[{i}]", "must not be empty")
    lengths = [len(r) for r in response_rows]
    mask = _optional_rows("response_mask", response_mask, lengths)
    old = _optional_rows("old_log_probs", old_log_probs, lengths)
    adv = _optional_rows("advantages", advantages, lengths)
    ref = _optional_rows("ref_log_probs", ref_log_probs, lengths)

    groups: list[Group] = []
    index: dict[tuple[Hashable, tuple[int, ...]], int] = {}
    positions: list[tuple[int, int]] = []
    for i, (uid, p, r) in enumerate(zip(uids, prompt_rows, response_rows)):
        key = (uid, tuple(p))
        g = index.get(key)
        if g is None:
            g = index[key] = len(groups)
            groups.append(Group(prompt=p, samples=[]))
        sample = Sample(
            tokens=r,
            logprobs=None if old is None else old[i],
            advantage=None if adv is None else adv[i],
            weights=None if mask is None else mask[i],
            ref_logprobs=None if ref is None else ref[i],
        )
        positions.append((g, len(groups[g].samples)))
        groups[g].samples.append(sample)
    return RowLayout(Batch(groups), positions)


def verl_padded_to_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    uids: Sequence[Hashable],
    *,
    response_lengths: Sequence[int] | None = None,
    old_log_probs: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
) -> RowLayout:
    """verl's right-padded tensors -> a floe Batch (as `verl_to_batch`).

    input_ids / attention_mask: [B, L], row i = prompt + response then padding, the mask 1 on
    the first L_i positions and 0 after. responses / response_mask: [B, R], row i = response
    then padding. response_lengths: R_i per row; default: up to the last 1 of response_mask
    (pass it when a response may end in masked tokens). The prompt is input_ids[i, :L_i - R_i];
    the response must equal input_ids[i, L_i - R_i : L_i] (InvalidInput("responses[i]")
    otherwise). old_log_probs / advantages / ref_log_probs: optional [B, R] response-aligned.
    """
    for name, t in (("input_ids", input_ids), ("attention_mask", attention_mask), ("responses", responses),
                    ("response_mask", response_mask)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise InvalidInput(name, f"must be a 2-D tensor [rows, width], got {_describe(t)}")
    if attention_mask.shape != input_ids.shape:
        raise InvalidInput("attention_mask", f"shape {tuple(attention_mask.shape)} differs from input_ids' "
                           f"{tuple(input_ids.shape)}")
    if response_mask.shape != responses.shape:
        raise InvalidInput("response_mask", f"shape {tuple(response_mask.shape)} differs from responses' "
                           f"{tuple(responses.shape)}")
    rows = input_ids.shape[0]
    if responses.shape[0] != rows or len(uids) != rows:
        raise InvalidInput("uids", f"input_ids ({rows}), responses ({responses.shape[0]}) and uids ({len(uids)}) "
                           "must have one entry per row")
    seq_lengths = [int(n) for n in attention_mask.ne(0).sum(-1).tolist()]
    for i, n in enumerate(seq_lengths):
        if not bool(attention_mask[i, :n].ne(0).all()):
            raise InvalidInput(f"attention_mask[{i}]", "must be right-padded: ones for the sequence, then zeros")
    if response_lengths is None:
        nonzero = response_mask.ne(0)
        last = torch.where(nonzero.any(-1), responses.shape[1] - nonzero.flip(-1).int().argmax(-1), 0)
        response_lengths = [int(n) for n in last.tolist()]
    elif len(response_lengths) != rows:
        raise InvalidInput("response_lengths", f"has {len(response_lengths)} entries for {rows} rows")
    prompt_rows, response_rows = [], []
    for i, (n, r) in enumerate(zip(seq_lengths, response_lengths)):
        if not 0 < r < n:
            raise InvalidInput(f"responses[{i}]", f"response length {r} must be in [1, {n - 1}] for a sequence of {n} "
                               "tokens (a non-empty prompt and response)")
        if r > responses.shape[1]:
            raise InvalidInput(f"response_lengths[{i}]", f"{r} exceeds the responses width {responses.shape[1]}")
        if not torch.equal(input_ids[i, n - r : n], responses[i, :r]):
            raise InvalidInput(f"responses[{i}]", "does not match the end of the row's input_ids")
        prompt_rows.append(input_ids[i, : n - r].tolist())
        response_rows.append(responses[i, :r].tolist())
    lengths = list(response_lengths)

    def opt(name: str, t: torch.Tensor | None) -> list[list[float]] | None:
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != rows:
            raise InvalidInput(name, f"must be a [{rows}, width] tensor, got {_describe(t)}")
        return unpad_rows(t, lengths, name)

    return verl_to_batch(
        prompt_rows, response_rows, uids,
        response_mask=unpad_rows(response_mask, lengths, "response_mask"),
        old_log_probs=opt("old_log_probs", old_log_probs),
        advantages=opt("advantages", advantages),
        ref_log_probs=opt("ref_log_probs", ref_log_probs),
    )


def verl_sequence_values(layout: RowLayout, values: Sequence[Sequence[Sequence[float]]]) -> list[list[float]]:
    """Per-token results [group][sample][token] (e.g. ForwardResult.logprobs or .entropy) as
    verl's whole-sequence rows: row i has prompt + response length, the value of response
    token t at position P_i + t - 1, zeros elsewhere (the last position and the prompt's
    first P_i - 1). verl's `response_from_nested` recovers exactly the response values.
    """
    out = []
    for (g, s), row in zip(layout.positions, layout.per_row(values)):
        prompt_len = len(layout.batch.groups[g].prompt)
        n_resp = len(layout.batch.groups[g].samples[s].tokens)
        if len(row) != n_resp:
            raise InvalidInput("values", f"row for group {g} sample {s} has {len(row)} values for {n_resp} tokens")
        full = [0.0] * (prompt_len + n_resp)
        full[prompt_len - 1 : prompt_len - 1 + n_resp] = [float(v) for v in row]
        out.append(full)
    return out


def verl_response_values(layout: RowLayout, values: Sequence[Sequence[Sequence[float]]],
                         width: int | None = None) -> torch.Tensor:
    """Per-token results [group][sample][token] as verl's right-padded response-aligned
    [B, width] tensor (width default: the longest response), zeros after each response."""
    return pad_rows(layout.per_row(values), width)


# -- SkyRL ------------------------------------------------------------------------------------
#
# SkyRL 0.4.0 (skyrl.train.dataset.preprocess.convert_prompts_responses_to_batch_tensors) lays a
# batch out as one left-padded block per row, `sequences[i] = [PAD.. | prompt_i | response_i]`
# with `attention_mask` 1 on real tokens, and every per-token field (`response_mask`,
# `loss_mask`, `action_log_probs`, `advantages`, ...) as a [B, R] tensor, R = the longest
# response, RIGHT-aligned: row i's k_i response values sit in the last k_i columns. Position j of
# a per-token field describes the response token at the same right-aligned position, i.e.
# log p(token | everything before it) — floe's alignment, so values move without shifting.


@dataclass
class SkyRLTensors:
    """A batch in SkyRL's layout: [B, S] left-padded `sequences` / `attention_mask`, [B, R]
    right-aligned per-token fields (None where the batch has no such field)."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    loss_mask: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


def _rows_2d(name: str, value: Any, rows: int | None = None, width: int | None = None) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dim() != 2:
        raise InvalidInput(name, f"must be a 2-D [batch, length] tensor, got shape {tuple(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise InvalidInput(name, f"has {t.shape[0]} rows but sequences has {rows}")
    if width is not None and t.shape[1] != width:
        raise InvalidInput(name, f"has width {t.shape[1]}, expected {width} (the response width R)")
    return t


def skyrl_to_batch(
    sequences: Any,
    attention_mask: Any,
    response_mask: Any | None = None,
    *,
    response_length: int | None = None,
    logprobs: Any | None = None,
    advantages: Any | None = None,
    ref_logprobs: Any | None = None,
    weights: Any | None = None,
    uids: Sequence[str] | None = None,
) -> RowLayout:
    """A SkyRL batch (left-padded rows, right-aligned [B, R] per-token fields) as a floe `Batch`.

    Each row's real tokens are `sequences[i][attention_mask[i] == 1]` (they must be one block
    at the right end). With `response_mask` ([B, R], 1 on the last k_i columns) row i's
    response is its last k_i real tokens and the rest is its prompt. Without it (SkyRL's
    forward passes only carry `response_length` = R), row i's sample is its last
    min(R, n_i - 1) real tokens, exactly the positions SkyRL scores. Rows with the same prompt
    tokens (and the same uid, when `uids` is given) become one `Group`, in order of first
    appearance, so floe runs each prompt once. Optional [B, R] fields become the samples'
    `logprobs`, per-token `advantage`, `ref_logprobs` and `weights`.

    Returns the `RowLayout` (batch + where each row went) that `skyrl_token_values` maps
    per-sample results back with. Raises InvalidInput naming the argument for a malformed batch.
    """
    seq = _rows_2d("sequences", sequences)
    b = seq.shape[0]
    att = _rows_2d("attention_mask", attention_mask, b, seq.shape[1])
    if uids is not None and len(uids) != b:
        raise InvalidInput("uids", f"has {len(uids)} entries but sequences has {b} rows")
    if response_mask is not None:
        resp = _rows_2d("response_mask", response_mask, b)
        width = resp.shape[1]
    elif response_length is not None:
        if response_length < 1:
            raise InvalidInput("response_length", f"must be >= 1, got {response_length}")
        resp, width = None, int(response_length)
    else:
        raise InvalidInput("response_mask", "give response_mask, or response_length when scoring a forward batch")
    fields: dict[str, torch.Tensor] = {}
    for name, value in (("logprobs", logprobs), ("advantages", advantages), ("ref_logprobs", ref_logprobs), ("weights", weights)):
        if value is not None:
            fields[name] = _rows_2d(name, value, b, width).to(torch.float64)

    groups: list[Group] = []
    where: dict[tuple[Any, ...], int] = {}
    positions: list[tuple[int, int]] = []
    seq_l, att_l = seq.tolist(), att.tolist()
    resp_l = resp.tolist() if resp is not None else None
    for i in range(b):
        n_real = int(sum(1 for a in att_l[i] if a))
        if n_real == 0 or any(a == 0 for a in att_l[i][len(att_l[i]) - n_real :]):
            raise InvalidInput(f"attention_mask[{i}]", "real tokens must be one non-empty block at the right end (left padding)")
        real = [int(x) for x in seq_l[i][len(seq_l[i]) - n_real :]]
        if resp_l is not None:
            k = int(sum(1 for r in resp_l[i] if r))
            if any(r == 0 for r in resp_l[i][width - k :]):
                raise InvalidInput(f"response_mask[{i}]", "response positions must be the last k columns (right-aligned)")
            if k >= n_real:
                raise InvalidInput(f"response_mask[{i}]", f"{k} response tokens leave no prompt token among {n_real} real tokens")
        else:
            k = min(width, n_real - 1)
            if k < 1:
                raise InvalidInput(f"attention_mask[{i}]", "a row needs at least two real tokens to score one")
        prompt, tokens = real[: n_real - k], real[n_real - k :]
        sample = Sample(tokens=tokens)
        lo = width - k
        if "logprobs" in fields:
            sample.logprobs = fields["logprobs"][i, lo:].tolist()
        if "advantages" in fields:
            sample.advantage = fields["advantages"][i, lo:].tolist()
        if "ref_logprobs" in fields:
            sample.ref_logprobs = fields["ref_logprobs"][i, lo:].tolist()
        if "weights" in fields:
            sample.weights = fields["weights"][i, lo:].tolist()
        key = (uids[i] if uids is not None else None, *prompt)
        if key not in where:
            where[key] = len(groups)
            groups.append(Group(prompt=prompt, samples=[]))
        g = where[key]
        positions.append((g, len(groups[g].samples)))
        groups[g].samples.append(sample)
    return RowLayout(Batch(groups), positions)


def skyrl_token_values(layout: RowLayout, values: Sequence[Sequence[Sequence[float]]], width: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-sample token values (e.g. `ForwardResult.logprobs`, [group][sample][token]) in
    SkyRL's [B, width] right-aligned layout: row i's k_i values (k_i = its sample's token count)
    in the last k_i columns, 0 elsewhere.

    Raises InvalidInput("values[i]") when row i's values are not one per token of its sample.
    """
    out = torch.zeros(len(layout.positions), width, dtype=dtype)
    for i, (g, s) in enumerate(layout.positions):
        vals, k = values[g][s], len(layout.batch.groups[g].samples[s].tokens)
        if len(vals) != k or k > width:
            raise InvalidInput(f"values[{i}]", f"row {i} has {len(vals)} values for {k} tokens (width {width})")
        if k:
            out[i, width - k :] = torch.as_tensor(list(vals), dtype=dtype)
    return out


def batch_to_skyrl(batch: Batch, pad_token_id: int = 0) -> SkyRLTensors:
    """A floe `Batch` in SkyRL's layout, one row per sample in group order (the inverse of
    `skyrl_to_batch`): `sequences` left-padded to max(prompt + response), per-token fields
    right-aligned in [B, R] with R the longest sample. A field is returned only when every
    sample has it; `loss_mask` carries the samples' weights (1 where a sample has none), and
    a scalar advantage is spread over the sample's tokens."""
    rows = [(g.prompt, s) for g in batch.groups for s in g.samples]
    if not rows:
        raise InvalidInput("batch", "has no samples")
    total = max(len(p) + len(s.tokens) for p, s in rows)
    width = max(len(s.tokens) for _, s in rows)
    b = len(rows)
    seq = torch.full((b, total), pad_token_id, dtype=torch.long)
    att = torch.zeros(b, total, dtype=torch.long)
    resp = torch.zeros(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width, dtype=torch.float32)
    have = {name: all(getattr(s, attr) is not None for _, s in rows) for name, attr in
            (("logprobs", "logprobs"), ("advantages", "advantage"), ("ref_logprobs", "ref_logprobs"))}
    per_token = {name: torch.zeros(b, width, dtype=torch.float32) for name, ok in have.items() if ok}
    for i, (prompt, s) in enumerate(rows):
        real = list(prompt) + list(s.tokens)
        k = len(s.tokens)
        seq[i, total - len(real) :] = torch.tensor(real, dtype=torch.long)
        att[i, total - len(real) :] = 1
        if k == 0:
            continue
        resp[i, width - k :] = 1
        loss_mask[i, width - k :] = torch.tensor(s.weights if s.weights is not None else [1.0] * k)
        if "logprobs" in per_token:
            per_token["logprobs"][i, width - k :] = torch.tensor(s.logprobs)
        if "ref_logprobs" in per_token:
            per_token["ref_logprobs"][i, width - k :] = torch.tensor(s.ref_logprobs)
        if "advantages" in per_token:
            adv = s.advantage if isinstance(s.advantage, list) else [float(s.advantage)] * k  # type: ignore[arg-type]
            per_token["advantages"][i, width - k :] = torch.tensor(adv)
    return SkyRLTensors(seq, att, resp, loss_mask, per_token.get("logprobs"), per_token.get("advantages"),
                        per_token.get("ref_logprobs"))
