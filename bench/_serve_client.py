"""The load-generating client of serve_load.py: seeded prompts, request bodies, one timed streaming chat completion."""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import httpx

# Common English words: nearly all are one token (with their leading space) in BPE vocabularies, so
# N words make a user message of about N tokens. The exact prompt length comes back in each usage chunk.
WORDS = """
the of and to in is was for on that with as by at from his it an were are which this be or has had
not but one their after first new two its who they have been also her other all more time most can
year only over into some would than later three such during these years may then when him where well
used part team many made him world city season both state known back however school while about
under game river before between four around film called people through since number high series
group name north south east west music album family early five life each being band house three
war area end found became member long take work play day line point water place light stone green
""".split()
WORDS = list(dict.fromkeys(WORDS))  # each word once

OUTPUT_DELTA_KEYS = ("content", "reasoning_content", "tool_calls")  # a delta carrying one of these is output


def make_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def level_prompts(seed: int, level_index: int, count: int, words: int) -> list[tuple[str, int]]:
    """(user message, sampling seed) per request; str seeds are stable across processes."""
    rng = random.Random(f"serve_load/{seed}/{level_index}")
    return [(make_prompt(rng, words), rng.randrange(1 << 31)) for _ in range(count)]


def shared_prefix(seed: int, words: int) -> str | None:
    """The system message every request carries, or None for `words` == 0."""
    return make_prompt(random.Random(f"serve_load/{seed}/prefix"), words) if words else None


def request_body(
    model: str, prompt: tuple[str, int], prefix: str | None, *, max_tokens: int, temperature: float
) -> dict:
    """A streaming /v1/chat/completions body that asks for the usage chunk."""
    prompt, seed = prompt
    messages = ([{"role": "system", "content": prefix}] if prefix else []) + [{"role": "user", "content": prompt}]
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    """One streaming chat completion, timed from just before the request is sent."""
    record = {"ok": False, "error": None, "status": None, "ttft_s": None, "latency_s": None, "gaps_s": []}
    deltas, usage, finish, done, last_content, kinds = 0, None, None, False, None, Counter()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record["error"] = f"HTTP {response.status_code}: {text[:200]}"
                record["latency_s"] = time.perf_counter() - t0
                return record
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    carried = [k for k in OUTPUT_DELTA_KEYS if delta.get(k)]
                    for kind in carried:
                        kinds[kind] += 1
                    if carried:
                        if last_content is None:
                            record["ttft_s"] = now - t0
                        else:
                            record["gaps_s"].append(now - last_content)
                        last_content = now
                        deltas += 1
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        record["error"] = f"{type(err).__name__}: {err}"[:200]
        record["latency_s"] = time.perf_counter() - t0
        return record
    record["latency_s"] = time.perf_counter() - t0
    record["content_deltas"] = deltas
    record["delta_kinds"] = dict(kinds)
    record["finish_reason"] = finish
    if usage:
        record["completion_tokens"] = usage.get("completion_tokens")
        record["prompt_tokens"] = usage.get("prompt_tokens")
        record["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if not done:
        record["error"] = "stream ended without [DONE]"
    elif usage is None:
        record["error"] = "no usage in the stream (stream_options.include_usage was sent)"
    elif record["ttft_s"] is None:
        record["error"] = "no output delta (content, reasoning_content or tool_calls)"
    else:
        record["ok"] = True
        tokens = record["completion_tokens"] or 0
        if tokens > 1:  # per-request time per output token after the first
            record["tpot_s"] = (last_content - t0 - record["ttft_s"]) / (tokens - 1)
    return record
