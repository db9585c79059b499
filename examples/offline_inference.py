"""Offline batch generation and chat with the LLM API (vLLM's spelling).

python examples/offline_inference.py                                  # the demo model (random weights)
python examples/offline_inference.py --model /path/to/ckpt            # a Hugging Face checkpoint folder
python examples/offline_inference.py --model deepseek-ai/DeepSeek-V3  # a Hub id, into the Hub cache
"""

import argparse

from deepinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--accelerator", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()

    llm = LLM(model=args.model, accelerator=args.accelerator, dtype=args.dtype, seed=args.seed)
    prompts = [
        "The capital of France is",
        {"prompt": "def fibonacci(n):"},  # vLLM's prompt dicts work too, as do {"prompt_token_ids": [...]}
        "Mixture-of-experts models route each token",
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=16),  # greedy
        SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, logprobs=2),
        SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=16, stop=("\n",)),
    ]
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        print(f"{output.prompt!r} -> {completion.text!r}")
        print(f"    {len(completion.token_ids)} tokens, finish reason {completion.finish_reason}")
        if completion.logprobs:  # vLLM's shape: per token {token id: Logprob}
            first = {entry.decoded_token: round(entry.logprob, 3) for entry in completion.logprobs[0].values()}
            print(f"    top logprobs of the first token: {first}")

    conversation = [{"role": "user", "content": "Name three prime numbers."}]
    [reply] = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    print(f"chat -> {reply.outputs[0].text!r}")


if __name__ == "__main__":
    main()
