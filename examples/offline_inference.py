"""Offline batch generation with the LLM API.

    python examples/offline_inference.py                         # the embedded demo model (random weights)
    python examples/offline_inference.py --model /path/to/ckpt   # a Hugging Face DeepSeek-V3 checkpoint
"""

import argparse

from deepinfer_core.engine.llm import LLM
from deepinfer_core.sampling.params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--accelerator", default=None)
    args = parser.parse_args()

    llm = LLM(model=args.model, accelerator=args.accelerator)
    prompts = ["The capital of France is", "def fibonacci(n):", "Mixture-of-experts models route each token"]
    params = [
        SamplingParams(temperature=0, max_tokens=16),  # greedy
        SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, logprobs=2),
        SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=16, stop=("\n",)),
    ]
    for output in llm.generate(prompts, params):
        completion = output.outputs[0]
        print(f"{output.prompt!r} -> {completion.text!r}")
        print(f"    {len(completion.token_ids)} tokens, finish reason {completion.finish_reason}")
        if completion.top_logprobs:
            print(f"    top logprobs of the first token: {completion.top_logprobs[0]}")


if __name__ == "__main__":
    main()
