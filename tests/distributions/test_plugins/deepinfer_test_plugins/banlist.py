"""Bans token 0, counts finished requests, registers a model architecture name."""

from deepinfer_core.backend import API_VERSION, hookimpl

DEEPINFER_API_VERSION = API_VERSION


def ban_token_zero(prompt_ids, output_ids, logits):
    logits = logits.clone()
    logits[0] = float("-inf")
    return logits


class FinishedCounter:
    def __init__(self):
        self.finished = 0

    def on_request(self, event):
        self.finished += event.kind == "finished"

    def on_step(self, stats):
        pass


@hookimpl
def deepinfer_logits_processors(model_name):
    return [ban_token_zero]


@hookimpl
def deepinfer_observers():
    return [FinishedCounter()]


@hookimpl
def deepinfer_register_models(registry):
    registry.register("TestBanlistForCausalLM", lambda **kwargs: "test model")
