"""OpenAI-compatible endpoints over plain HTTP: completions (text or token-id prompts), chat with
the chat template, logprobs, greedy decoding, token ids in the answer, the short default model
id, ignore_eos, chat's default max_tokens, text offsets that index the returned text (special
tokens included), and errors in OpenAI's shape naming the user's field."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from floe.server.protocols.openai_render import Answer, Renderer, render, stream
from floe.server.state import default_model_id
from floe.types import SampledGroup, SampledSequence, SampleResult

from .conftest import ServerProcess

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def http(shared_server: ServerProcess):
    with httpx.Client(base_url=shared_server.url, headers=shared_server.headers(), timeout=120) as client:
        yield client


def test_models_lists_the_directory_name_not_the_path(http: httpx.Client, server_model) -> None:
    data = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [server_model.name] == ["tiny"]
    assert data[0]["object"] == "model" and data[0]["max_model_len"] == 1024
    # the full path given as backend.model is accepted too
    r = http.post("/v1/completions", json={"model": str(server_model), "prompt": "ab", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_completions_text_and_token_prompts(http: httpx.Client) -> None:
    model = http.get("/v1/models").json()["data"][0]["id"]
    r = http.post("/v1/completions", json={"model": model, "prompt": ["ab", "cd"], "n": 2, "max_tokens": 5, "logprobs": 0, "seed": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and len(body["choices"]) == 4
    choice = body["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]) <= 5
    assert choice["logprobs"]["top_logprobs"] is None  # logprobs: 0 = no alternatives
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == len(body["choices"][0]["prompt_token_ids"]) + len(body["choices"][2]["prompt_token_ids"])
    ids = [body["choices"][0]["prompt_token_ids"], body["choices"][2]["prompt_token_ids"]]
    again = http.post("/v1/completions", json={"prompt": ids, "n": 2, "max_tokens": 5, "seed": 1}).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in body["choices"]]  # ids == text


def test_chat_greedy_is_deterministic_and_uses_the_template(http: httpx.Client) -> None:
    req = {"messages": HI, "temperature": 0, "max_tokens": 6, "logprobs": True}
    a, b = http.post("/v1/chat/completions", json=req).json(), http.post("/v1/chat/completions", json=req).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["object"] == "chat.completion" and a["choices"][0]["message"]["role"] == "assistant"
    assert len(a["choices"][0]["logprobs"]["content"]) == len(a["choices"][0]["token_ids"])
    assert all(e["top_logprobs"] == [] for e in a["choices"][0]["logprobs"]["content"])
    tok_prompt = a["choices"][0]["prompt_token_ids"]
    assert tok_prompt[-1] != tok_prompt[0] and len(tok_prompt) > 2  # role markers + "hi" + generation prompt


def test_chat_max_tokens_defaults_to_the_remaining_context(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"messages": HI, "ignore_eos": True, "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 1024  # the model's context


def test_ignore_eos_keeps_sampling_past_the_eos_token(http: httpx.Client, server_model) -> None:
    eos_id = AutoTokenizer.from_pretrained(server_model).eos_token_id
    req = {"prompt": "ab", "n": 16, "max_tokens": 64, "seed": 11}
    stopping = http.post("/v1/completions", json=req).json()["choices"]
    stopped = [c for c in stopping if c["finish_reason"] == "stop"]
    assert stopped and all(c["token_ids"][-1] == eos_id for c in stopped)
    ignoring = http.post("/v1/completions", json={**req, "ignore_eos": True}).json()["choices"]
    assert all(c["finish_reason"] == "length" and len(c["token_ids"]) == 64 for c in ignoring)
    assert any(eos_id in c["token_ids"] for c in ignoring)  # sampled, and sampling went on


@pytest.mark.parametrize("route, extra, status, param, code, words", [
    ("/v1/chat/completions", {"presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter", "not supported"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, 400, "response_format", "unsupported_parameter", "not supported"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "unsupported_parameter", "not supported"),
    ("/v1/completions", {"echo": True}, 400, "echo", "unsupported_parameter", "not supported"),
    ("/v1/chat/completions", {"temprature": 0.5}, 400, "temprature", "unknown_parameter", "check the spelling"),
    ("/v1/chat/completions", {"temperature": "hot"}, 400, "temperature", "invalid_value", "number"),
    ("/v1/chat/completions", {"max_tokens": 5000}, 400, "max_tokens", "invalid_value", "exceeds the context"),
    ("/v1/chat/completions", {"max_completion_tokens": 5000}, 400, "max_completion_tokens", "invalid_value", "exceeds"),
    ("/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, 400, "top_logprobs", "invalid_value", "20"),
    ("/v1/chat/completions", {"top_logprobs": 2}, 400, "top_logprobs", "invalid_value", "logprobs: true"),
    ("/v1/completions", {"logprobs": 21}, 400, "logprobs", "invalid_value", "20"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 99999]]}, 400, "prompt[1]", "invalid_value", "vocabulary"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", "invalid_value", "vocabulary"),
    ("/v1/completions", {"prompt": 7}, 400, "prompt", "invalid_value", "token ids"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value", "stream: true"),
    ("/v1/completions", {"model": "gpt-4"}, 404, "model", "model_not_found", "'tiny'"),
    ("/v1/completions", {"seed": 2**70}, 400, "seed", "invalid_value", "[0, 2**63)"),
    ("/v1/completions", {"seed": -1}, 400, "seed", "invalid_value", "[0, 2**63)"),
    ("/v1/chat/completions", {"seed": 2**63}, 400, "seed", "invalid_value", "[0, 2**63)"),
    ("/v1/completions", {"top_k": 2**70}, 400, "top_k", "invalid_value", "integer in [0, 2147483648)"),
    ("/v1/completions", {"prompt": [5] * 1100, "max_tokens": 2}, 400, "prompt", "context_length_exceeded", "no room"),
    ("/v1/completions", {"prompt": [[5], [5] * 1024], "max_tokens": 2}, 400, "prompt[1]", "context_length_exceeded", "1024 tokens"),
    ("/v1/completions", {"prompt": [5] * 1023, "max_tokens": 2}, 400, "max_tokens", "invalid_value", "exceeds the context"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 1100}], "max_tokens": 2}, 400, "messages",
     "context_length_exceeded", "no room"),
])
def test_errors_have_openai_shape_and_the_users_field(
    http: httpx.Client, route: str, extra: dict, status: int, param: str, code: str, words: str
) -> None:
    base = {"messages": HI} if route.endswith("chat/completions") else {"prompt": "ab"}
    limit = {} if any(k.startswith("max_") for k in extra) else {"max_tokens": 4}
    r = http.post(route, json={**base, **limit, **extra})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == code, error
    assert words in error["message"] and error["message"].startswith(param), error
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_no_op_values_of_unsupported_fields_are_accepted(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={
        "messages": HI, "max_tokens": 3, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "tools": [],
    })
    assert r.status_code == 200, r.text


def test_auth_and_unknown_routes_answer_in_openai_shape(shared_server: ServerProcess) -> None:
    r = httpx.post(f"{shared_server.url}/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(f"{shared_server.url}/v1/embeddings", headers=shared_server.headers())
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    # floe's own routes keep floe's error shape
    r = httpx.post(f"{shared_server.url}/api/nope", headers=shared_server.headers())
    assert r.status_code == 404 and r.json()["error"] == "not_found"


def test_default_model_id_is_short(tmp_path) -> None:
    assert default_model_id("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a hub id as given
    assert default_model_id(str(tmp_path / "my-model")) == "my-model"
    assert default_model_id(str(tmp_path / "my-model") + "/") == "my-model"
    snapshot = "/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/0123abcd"
    assert default_model_id(snapshot) == "Qwen/Qwen3-0.6B"


# -- text offsets ---------------------------------------------------------------------------------


def _offset_slices(text: str, offsets: list[int]) -> list[str]:
    """Each token's contribution to `text` according to its text offsets."""
    ends = [*offsets[1:], len(text)]
    return [text[a:b] for a, b in zip(offsets, ends)]


@pytest.mark.parametrize("pieces, stop_reason, stop, text, offsets", [
    # the reviewer's answer: two special tokens in the middle contribute nothing
    (["j", "<eos>", "<|user|>", "r", "*", "4"], "length", [], "jr*4", [0, 1, 1, 1, 2, 3]),
    # special tokens first, and a final stop token (not part of the text)
    (["<|user|>", "a", "b", "<|end|>"], "stop_token", [], "ab", [0, 0, 1, 2]),
    # the text is cut before a stop string: the tokens past the cut add nothing
    (["a", "x", "y", "b"], "stop_string", ["xy"], "a", [0, 1, 1, 1]),
])
def test_text_offsets_index_the_returned_text(server_model, pieces, stop_reason, stop, text, offsets) -> None:
    tok = AutoTokenizer.from_pretrained(server_model)
    ids = tok.convert_tokens_to_ids(pieces)
    assert tok.unk_token_id not in ids  # every piece is one real token of the tiny vocabulary
    seq = SampledSequence(ids, [-1.0] * len(ids), stop_reason, 0, 1.0)
    answer = Answer("completion", "tiny", SampleResult([SampledGroup([5], [seq])], 0, len(ids), 0.0), stop, True, 0)
    choice = render(answer, Renderer(tok, stop))["choices"][0]
    assert choice["text"] == text
    assert choice["logprobs"]["tokens"] == pieces  # special tokens are still listed, as sampled
    assert choice["logprobs"]["text_offset"] == offsets
    assert "".join(_offset_slices(text, offsets)) == text
    # streamed: the same offsets, one per chunk, each where its chunk's text starts
    chunks = [json.loads(e.removeprefix("data: ")) for e in stream(answer, Renderer(tok, stop)) if "[DONE]" not in e]
    chunks = [c["choices"][0] for c in chunks if c["choices"]]
    assert [c["logprobs"]["text_offset"][0] for c in chunks] == offsets
    assert [c["text"] for c in chunks] == _offset_slices(text, offsets)


def test_text_offsets_over_http_cover_the_text_exactly(http: httpx.Client, server_model) -> None:
    """Sampled answers (special tokens included) with logprobs: for every token i,
    text[offset_i:offset_(i+1)] is what it adds, and special tokens add nothing."""
    tok = AutoTokenizer.from_pretrained(server_model)
    special = set(tok.all_special_ids) | {i for i in range(len(tok)) if tok.decode([i], skip_special_tokens=True) == ""}
    r = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 16, "n": 8, "seed": 2, "logprobs": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    seen_special = 0
    for choice in r.json()["choices"]:
        text, offsets = choice["text"], choice["logprobs"]["text_offset"]
        assert len(offsets) == len(choice["token_ids"]) and offsets == sorted(offsets) and offsets[-1] <= len(text)
        slices = _offset_slices(text, offsets)
        assert "".join(slices) == text
        for token, piece in zip(choice["token_ids"], slices):
            if token in special:
                seen_special += 1
                assert piece == ""
    assert seen_special > 0  # the check above met special tokens
