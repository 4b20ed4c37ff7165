"""Chat messages -> prompt token ids, and multi-turn continuation without re-tokenising.

`Renderer` wraps a tokenizer's chat template (any transformers tokenizer that has one):

* `render(messages)`: the token ids of a conversation with the assistant's generation prompt
  appended, ready for `client.sample`;
* `next_prompt(prompt, seq, history, new)`: the prompt of the next turn after the model
  answered `prompt` with `seq` (a `floe.SampledSequence`) and the user / environment replied
  with `new` messages: the previous prompt tokens + the completion tokens (verbatim) + the
  tokens the chat template writes after an assistant message's content (e.g.
  ``<|im_end|>\\n``, minus the stop token the sampler already produced) + the rendered new
  messages. No completion is ever decoded and re-encoded, so the policy keeps seeing, and is
  trained on, exactly the tokens it sampled. Templates that rewrite history (Qwen3 drops
  earlier ``<think>`` blocks) are not followed there;
* `decode(tokens)`: a completion's text, special tokens skipped.

A message is a dict {"role": "system" | "user" | "assistant", "content": str}. floe's RL loop
(`floe.rl.rollouts`) uses this same renderer.
"""

from __future__ import annotations

from typing import Any

from floe.types import SampledSequence

Message = dict[str, Any]  # {"role": "system" | "user" | "assistant", "content": str}


# Stands in for an assistant message's content so the template's text around it can be found;
# plain letters, so templates that trim or split content (on </think>) leave it whole.
_CONTENT_MARK = "FloeAssistantContentMark"


class Renderer:
    """Chat messages -> prompt token ids with the tokenizer's chat template (module docstring).

    tokenizer: a transformers tokenizer with a chat template, e.g. `client.tokenizer()`.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def render(self, messages: list[Message]) -> list[int]:
        """Token ids of ``messages`` rendered with the generation prompt of an assistant turn."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def after_assistant(self, history: list[Message], new: list[Message]) -> str:
        """The text the chat template writes between the content of an assistant message that
        follows ``history`` and the next assistant turn's generation point, ``new`` (the env's
        next messages) included: e.g. ``<|im_end|>\\n<|im_start|>user\\n...<|im_start|>assistant\\n``.

        Found by rendering the conversation with a marker as the assistant's content, so it
        holds for any template. ValueError when the template does not show the content once.
        """
        convo = history + [{"role": "assistant", "content": _CONTENT_MARK}] + new
        text = self.tokenizer.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
        if text.count(_CONTENT_MARK) != 1:
            raise ValueError("the chat template does not render an assistant message's content exactly once")
        return text[text.index(_CONTENT_MARK) + len(_CONTENT_MARK) :]

    def next_prompt(
        self, prompt: list[int], seq: SampledSequence, history: list[Message], new: list[Message]
    ) -> list[int]:
        """The prompt of the turn after ``seq`` (sampled for ``prompt``, whose conversation is
        ``history``): ``prompt + seq.tokens`` verbatim, then the template's text after the
        assistant's content (``after_assistant``) tokenised, less the stop token ``seq`` ended
        with when the template writes that token there itself."""
        rest = self.after_assistant(history, new)
        if seq.tokens and (seq.stop_reason == "stop_token" or seq.tokens[-1] in self.tokenizer.all_special_ids):
            stop_text = self.tokenizer.decode(seq.tokens[-1:], skip_special_tokens=False)
            if stop_text and rest.startswith(stop_text):
                rest = rest[len(stop_text) :]
        return prompt + seq.tokens + self.tokenizer.encode(rest, add_special_tokens=False)

    def decode(self, tokens: list[int]) -> str:
        """The text of `tokens` (e.g. a completion), special tokens skipped."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
