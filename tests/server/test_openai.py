"""OpenAI-compatible endpoints: completions (text or token-id prompts), chat with the chat
template, logprobs, greedy decoding, token ids in the answer, strict field checking."""

from __future__ import annotations

import httpx
import pytest

from .conftest import ServerProcess


@pytest.fixture
def http(shared_server: ServerProcess):
    with httpx.Client(base_url=shared_server.url, headers=shared_server.headers(), timeout=60) as client:
        yield client


def test_models_lists_the_served_model(http: httpx.Client, shared_server: ServerProcess) -> None:
    data = http.get("/v1/models").json()["data"]
    assert len(data) == 1 and data[0]["object"] == "model"


def test_completions_text_and_token_prompts(http: httpx.Client) -> None:
    model = http.get("/v1/models").json()["data"][0]["id"]
    r = http.post("/v1/completions", json={"model": model, "prompt": ["ab", "cd"], "n": 2, "max_tokens": 5, "logprobs": 0, "seed": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and len(body["choices"]) == 4
    choice = body["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]) <= 5
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])
    ids = [body["choices"][0]["prompt_token_ids"], body["choices"][2]["prompt_token_ids"]]
    again = http.post("/v1/completions", json={"prompt": ids, "n": 2, "max_tokens": 5, "seed": 1}).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in body["choices"]]  # ids == text
    wrong = http.post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert wrong.status_code == 422 and wrong.json()["field"] == "request.model"


def test_chat_greedy_is_deterministic_and_uses_the_template(http: httpx.Client) -> None:
    req = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 6, "logprobs": True}
    a, b = http.post("/v1/chat/completions", json=req).json(), http.post("/v1/chat/completions", json=req).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["object"] == "chat.completion" and a["choices"][0]["message"]["role"] == "assistant"
    assert len(a["choices"][0]["logprobs"]["content"]) == len(a["choices"][0]["token_ids"])
    tok_prompt = a["choices"][0]["prompt_token_ids"]
    assert tok_prompt[-1] != tok_prompt[0] and len(tok_prompt) > 2  # role markers + "hi" + generation prompt


@pytest.mark.parametrize("extra, field", [
    ({"presence_penalty": 0.5}, "request.presence_penalty"),
    ({"stream": True}, "request.stream"),
    ({"top_logprobs": 3}, "request.top_logprobs"),
    ({"temperature": "hot"}, "request.temperature"),
])
def test_unsupported_fields_are_422_naming_the_field(http: httpx.Client, extra: dict, field: str) -> None:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **extra})
    assert r.status_code == 422 and r.json()["field"] == field, r.text
