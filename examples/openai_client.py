"""Talk to `deepinfer serve` with the official OpenAI and Anthropic clients.

    deepinfer serve --port 8000 &          # the embedded demo model (random weights)
    python examples/openai_client.py --base-url http://127.0.0.1:8000
"""

import argparse

import anthropic
from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused", help="the server's --api-key, if it has one")
    args = parser.parse_args()

    client = OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, stream=True, seed=1
    )
    print("chat (streamed): ", end="")
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    response = client.responses.create(model=model, input="Say hello.", max_output_tokens=16)
    print(f"responses: {response.output_text!r}")

    claude_style = anthropic.Anthropic(base_url=args.base_url, api_key=args.api_key)
    message = claude_style.messages.create(model=model, max_tokens=16, messages=[{"role": "user", "content": "Hi"}])
    print(f"messages: {message.content[0].text!r} ({message.usage.output_tokens} tokens)")


if __name__ == "__main__":
    main()
