"""General SFT (`floe sft` with `[sft] data`): a user's chat or prompt/completion rows.

`load_rows` reads the rows before any model loads: a .jsonl / .json / .parquet file
(floe.envs.datafile), a directory written by `datasets`' ``save_to_disk`` or a Hugging Face
hub dataset name (both need the `datasets` extra). `check_rows` checks every row's shape, so a
bad row fails naming its index before the model loads. `data_batches` turns the rows into the
per-step batches `floe.rl.warmstart.sft_train` trains on.

A row is one example, in one of two forms (field names set in `[sft]`):

* chat: ``messages`` = [{"role", "content"}, ...] ending with an assistant message; that last
  message is the target, the messages before it (rendered with the chat template and the
  assistant generation prompt) the prompt;
* prompt/completion: ``prompt`` a string (rendered as one user message, or used as plain text
  when ``chat_template = false``) or a message list; ``completion`` a string or a message list
  whose last message is the assistant's.

The target is the completion's tokens plus the tokenizer's end-of-sequence token, weighted 1;
the prompt is not trained on. Each step takes the next ``batch_size`` rows of a seeded
shuffle, reshuffled at every pass over the data.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from floe.envs.datafile import read_rows
from floe.errors import InvalidInput
from floe.rl.config import SftDataConfig
from floe.rl.preflight import require_extra
from floe.rl.rollouts import Renderer
from floe.types import Batch, Group, Sample

FIELD = "recipe.sft.data"


def load_rows(cfg: SftDataConfig, field: str = FIELD) -> list[dict[str, Any]]:
    """The rows of ``cfg.data`` (module docstring); InvalidInput naming ``field`` when the source
    is missing, unreadable, empty or needs a package that is not installed."""
    assert cfg.data is not None
    source = cfg.data
    path = Path(source).expanduser()
    if path.is_file():
        try:
            rows = read_rows(str(path), (), option=field)
        except ValueError as e:
            raise InvalidInput(field, str(e).removeprefix(f"{field}: ")) from None
    elif path.is_dir():
        require_extra("datasets", "datasets", field)
        import datasets  # noqa: PLC0415 - an optional extra

        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise InvalidInput(field, f"{source} is not a dataset saved by datasets.save_to_disk: {e}") from None
        rows = _split_rows(loaded, cfg.split, source)
    elif source.startswith((".", "/", "~")) or path.suffix.lower() in (".jsonl", ".json", ".parquet"):
        raise InvalidInput(field, f"no such file or directory: {source}")
    else:
        require_extra("datasets", "datasets", field)
        import datasets  # noqa: PLC0415 - an optional extra

        try:
            rows = datasets.load_dataset(source, split=cfg.split).to_list()
        except Exception as e:  # noqa: BLE001 - hub and loader errors are the user's to fix
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise InvalidInput(field, f"cannot load the dataset {source!r} (split {cfg.split!r}): {reason}") from None
    if not rows:
        raise InvalidInput(field, f"{source} holds no rows")
    check_rows(rows, cfg, field)
    return rows


def _split_rows(loaded: Any, split: str, source: str) -> list[dict[str, Any]]:
    if hasattr(loaded, "keys") and not hasattr(loaded, "features"):  # a DatasetDict
        if split not in loaded:
            raise InvalidInput("recipe.sft.split", f"{source} has no split {split!r}; splits: {', '.join(loaded.keys())}")
        loaded = loaded[split]
    return loaded.to_list()  # type: ignore[no-any-return]


def check_rows(rows: list[dict[str, Any]], cfg: SftDataConfig, field: str = FIELD) -> None:
    """InvalidInput naming the first row that is not a chat or a prompt/completion pair."""
    for i, row in enumerate(rows):
        problem = _row_problem(row, cfg)
        if problem:
            raise InvalidInput(field, f"row {i}: {problem}")


def _row_problem(row: Any, cfg: SftDataConfig) -> str | None:
    if not isinstance(row, dict):
        return "is not an object"
    if cfg.messages_field in row:
        messages = row[cfg.messages_field]
        if not _is_messages(messages) or not messages:
            return f"{cfg.messages_field!r} must be a non-empty list of {{role, content}} messages"
        if messages[-1]["role"] != "assistant":
            return f"the last message of {cfg.messages_field!r} must be the assistant's (the target)"
        return None
    if cfg.prompt_field in row and cfg.completion_field in row:
        prompt, completion = row[cfg.prompt_field], row[cfg.completion_field]
        if not (isinstance(prompt, str) or _is_messages(prompt)):
            return f"{cfg.prompt_field!r} must be a string or a list of {{role, content}} messages"
        if isinstance(completion, str):
            return None
        if not _is_messages(completion) or not completion or completion[-1]["role"] != "assistant":
            return f"{cfg.completion_field!r} must be a string or messages ending with the assistant's"
        return None
    return (f"has neither {cfg.messages_field!r} nor {cfg.prompt_field!r} + {cfg.completion_field!r} "
            f"(columns: {', '.join(map(str, row)) or 'none'}); set [sft] messages_field / prompt_field / completion_field")


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def example_tokens(row: dict[str, Any], cfg: SftDataConfig, renderer: Renderer) -> tuple[list[int], list[int]]:
    """(prompt tokens, target tokens + eos) of one checked row (module docstring)."""
    tok = renderer.tokenizer
    if cfg.messages_field in row:
        messages = row[cfg.messages_field]
        prompt, target = renderer.render(messages[:-1]), messages[-1]["content"]
    else:
        given, completion = row[cfg.prompt_field], row[cfg.completion_field]
        if isinstance(given, list):
            prompt = renderer.render(given)
        elif cfg.chat_template:
            prompt = renderer.render([{"role": "user", "content": given}])
        else:
            prompt = tok.encode(given, add_special_tokens=False)
        target = completion if isinstance(completion, str) else completion[-1]["content"]
    return prompt, tok.encode(target, add_special_tokens=False) + [tok.eos_token_id]


class DataBatches:
    """The per-step batches of `sft_train` from checked rows: the next `batch_size` rows of a
    shuffle drawn from the step rng, a new shuffle at each pass over the data. Rows are
    tokenised on first use; one whose prompt + target exceed `max_context` is an InvalidInput."""

    def __init__(self, rows: list[dict[str, Any]], cfg: SftDataConfig, batch_size: int, max_context: int | None = None):
        self.rows, self.cfg, self.batch_size, self.max_context = rows, cfg, batch_size, max_context
        self._examples: list[tuple[list[int], list[int]]] | None = None
        self._order: list[int] = []

    def __call__(self, renderer: Renderer, rng: random.Random) -> Batch:
        if self._examples is None:
            self._examples = [example_tokens(r, self.cfg, renderer) for r in self.rows]
            for i, (prompt, target) in enumerate(self._examples):
                if self.max_context is not None and len(prompt) + len(target) > self.max_context:
                    raise InvalidInput(FIELD, f"row {i} is {len(prompt) + len(target)} tokens, more than the model's "
                                              f"context of {self.max_context}; shorten or drop it")
        groups = []
        for _ in range(self.batch_size):
            if not self._order:
                self._order = list(range(len(self._examples)))
                rng.shuffle(self._order)
            prompt, target = self._examples[self._order.pop()]
            groups.append(Group(prompt, [Sample(list(target))]))
        return Batch(groups)
