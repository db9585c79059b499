"""vLLM's other routes on a live server: /tokenize and /detokenize (httpx), /version, /ping, and the model
cards of /v1/models and /v1/models/{id} (openai client). With --api-key, as in vLLM, only /v1 needs it."""

from __future__ import annotations

import importlib.metadata
import time

import httpx
import openai
import pytest

MODEL = "deepinfer-demo-deepseek-v4-random"
KEY = "secret"
TEXT = "Once upon a time, in a land far away"
MESSAGES = [{"role": "user", "content": "tell me a story"}]


def tokenize(http: httpx.Client, **body) -> dict:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- /tokenize and /detokenize ---------------------------------------------------------------------------


def test_tokenize_then_detokenize_round_trips(http, openai_client):
    answer = tokenize(http, model=MODEL, prompt=TEXT)
    assert answer["count"] == len(answer["tokens"]) > 0 and answer["max_model_len"] == 2048
    assert answer["token_strs"] is None
    r = http.post("/detokenize", json={"model": MODEL, "tokens": answer["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": TEXT}
    completion = openai_client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, temperature=0)
    assert completion.usage.prompt_tokens == answer["count"]
    by_ids = openai_client.completions.create(model=MODEL, prompt=answer["tokens"], max_tokens=1, temperature=0)
    assert by_ids.choices[0].text == completion.choices[0].text


def test_tokenize_messages_counts_what_chat_sends(http, openai_client):
    answer = tokenize(http, messages=MESSAGES)  # model is optional, as in vLLM
    chat = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    assert answer["count"] == chat.usage.prompt_tokens
    bare = tokenize(http, model=MODEL, messages=MESSAGES, add_generation_prompt=False)
    assert 0 < bare["count"] < answer["count"] and answer["tokens"][: bare["count"]] == bare["tokens"]
    assert "tell me a story" in http.post("/detokenize", json={"tokens": bare["tokens"]}).json()["prompt"]


def test_tokenize_returns_token_strings_on_request(http):
    answer = tokenize(http, prompt=TEXT, return_token_strs=True)
    strs = answer["token_strs"]
    assert len(strs) == answer["count"] and all(isinstance(s, str) and s for s in strs)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": 12}, 400, "prompt"),
        ("/tokenize", {"messages": "hi"}, 400, None),
        ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": "no"}, 400, "add_generation_prompt"),
        ("/tokenize", {"model": "nope", "prompt": TEXT}, 404, "model"),
        ("/detokenize", {"tokens": [1, -5]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ],
)
def test_bad_tokenizer_requests_are_refused(http, path, body, status, param):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["param"] == param


# ---- /version, /ping, /health ----------------------------------------------------------------------------


def test_version_is_the_installed_package_version(http):
    assert http.get("/version").json() == {"version": importlib.metadata.version("deepinfer")}


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_like_health(http, method):
    r = http.request(method, "/ping")
    assert r.status_code == 200 and r.json() == http.get("/health").json()


# ---- model cards -----------------------------------------------------------------------------------------


def test_model_card_has_vllms_fields(openai_client, server):
    listed = openai_client.models.list().data
    card = openai_client.models.retrieve(MODEL)
    assert [m.id for m in listed] == [card.id] == [MODEL]
    assert card.object == "model" and card.owned_by
    assert 0 < card.created <= time.time() and card.created == listed[0].created  # the server's start time
    extra = card.model_extra
    assert extra["max_model_len"] == 2048 and extra["root"] and extra["parent"] is None
    assert isinstance(extra["permission"], list)


def test_unknown_model_card_is_404(openai_client, http):
    with pytest.raises(openai.NotFoundError) as err:
        openai_client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and "no-such-model" in err.value.body["message"]
    assert http.get("/v1/models/org/" + MODEL).status_code == 404  # an id with a slash is an id, not a path


# ---- access control --------------------------------------------------------------------------------------


def test_only_v1_routes_need_the_key(auth_server):
    with httpx.Client(base_url=auth_server.url, timeout=60) as raw:
        assert raw.get(f"/v1/models/{MODEL}").status_code == 401
        bearer = {"authorization": f"Bearer {KEY}"}
        assert raw.get(f"/v1/models/{MODEL}", headers=bearer).json()["id"] == MODEL
        assert raw.post("/tokenize", json={"prompt": TEXT}).status_code == 200  # open in vLLM too
        assert raw.post("/detokenize", json={"tokens": [1, 2]}).status_code == 200
        assert raw.get("/version").status_code == 200 and raw.get("/ping").status_code == 200
