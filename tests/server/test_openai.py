"""OpenAI-compatible endpoints over plain HTTP: completions (text or token-id prompts), chat with
the chat template, logprobs, greedy decoding, token ids in the answer, the short default model
id, ignore_eos, chat's default max_tokens, and errors in OpenAI's shape naming the user's field."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from floe.server.protocols.openai import default_model_id

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
