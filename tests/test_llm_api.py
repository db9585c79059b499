"""The offline Python API as a vLLM user writes it: `from deepinfer import LLM, SamplingParams`, prompt forms,
chat, use_tqdm, dtype / kv_cache_dtype / gpu_memory_utilization / seed / tokenizer, vLLM-shaped logprobs."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

import deepinfer
from deepinfer import LLM, DeepInferError, Logprob, SamplingParams
from deepinfer_core.engine.tokenizer import demo_tokenizer_dir

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SMALL = dict(accelerator="cpu", max_num_seqs=4, kv_cache_memory_bytes=16 << 20, progress=False)
TINY = dict(accelerator="cpu", num_kv_blocks=16, progress=False)  # for the tiny V3 checkpoint


@pytest.fixture(scope="module")
def llm(one_torch_thread):
    return LLM(**SMALL)  # the embedded demo model


def test_the_package_exports_vllm_names_and_imports_quickly():
    probe = (
        "import sys, deepinfer; print(sorted(m for m in ('torch', 'deepinfer_core.engine.llm') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"  # nothing heavy until a name is used
    from deepinfer_core.engine.llm import LLM as CoreLLM
    from deepinfer_core.engine.request import CompletionOutput, RequestOutput
    from deepinfer_core.sampling.params import SamplingParams as CoreParams

    assert deepinfer.LLM is CoreLLM and deepinfer.SamplingParams is CoreParams
    assert deepinfer.RequestOutput is RequestOutput and deepinfer.CompletionOutput is CompletionOutput
    assert deepinfer.__version__.count(".") == 2
    with pytest.raises(AttributeError):
        deepinfer.NotAName  # noqa: B018


def test_every_prompt_form_gives_the_same_tokens(llm):
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text)
    forms = [text, {"prompt": text}, ids, {"prompt_token_ids": ids}, tuple(ids)]
    outputs = llm.generate(forms, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [tuple(ids)] * len(forms)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert len(tokens[0]) == 4 and tokens == [tokens[0]] * len(forms)
    assert outputs[0].prompt == outputs[1].prompt == text
    for single in forms[:4]:  # a lone prompt in any form is a batch of one
        [alone] = llm.generate(single, GREEDY, use_tqdm=False)
        assert alone.outputs[0].token_ids == tokens[0]


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (3.5, "prompts is a float"),
        ({"text": "hi"}, "exactly one key, 'prompt' (text) or 'prompt_token_ids'"),
        ({"prompt": 5}, "prompt['prompt'] must be a string"),
        ([[1, 2], 3.0], "prompts[1] is a float"),
        ([{"prompt_token_ids": [1, "x"]}], "prompts[0]['prompt_token_ids'][1] must be a token id"),
        (["ok", {"prompt": "a", "prompt_token_ids": [1]}], "prompts[1] is a dict with keys"),
    ],
)
def test_other_prompt_forms_are_refused_with_the_accepted_ones(llm, prompts, message):
    with pytest.raises(DeepInferError, match="prompt") as err:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert message in str(err.value)
    assert not llm.engine.has_unfinished()


def test_one_sampling_params_per_prompt_must_match_the_batch(llm):
    with pytest.raises(DeepInferError, match="2 prompts but 3 sampling parameter sets"):
        llm.generate(["a", "b"], [GREEDY] * 3, use_tqdm=False)


def test_chat_renders_like_the_server_and_equals_generate_on_those_ids(llm):
    import deepseek_recipe as dr

    from deepinfer_core.serve.state import build_recipe

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    _, encoding, options = build_recipe(str(demo_tokenizer_dir() / "tokenizer.json"), llm.model_name)
    body = {"model": llm.model_name, "messages": messages}
    ids = list(encoding.encode(dr.ChatCompletionRequest(body).convert(options).conversation))

    [chat] = llm.chat(messages, GREEDY, use_tqdm=False)
    [plain] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert chat.prompt_token_ids == tuple(ids)
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids and len(chat.outputs[0].token_ids) == 4
    assert chat.outputs[0].text == plain.outputs[0].text and chat.outputs[0].text
    assert chat.prompt.startswith("<｜begin▁of▁sentence｜>") and chat.prompt.endswith("<｜Assistant｜></think>")


def test_chat_takes_a_batch_of_conversations_and_thinking(llm):
    one = [{"role": "user", "content": "Hi"}]
    two = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "?"},
    ]
    outputs = llm.chat([one, two], GREEDY, use_tqdm=False)
    assert len(outputs) == 2 and outputs[1].prompt.count("<｜User｜>") == 2
    [thinking] = llm.chat(one, GREEDY, use_tqdm=False, chat_template_kwargs={"thinking": True})
    assert thinking.prompt.endswith("<｜Assistant｜><think>")


@pytest.mark.parametrize(
    ("messages", "kwargs", "message"),
    [
        ([{"role": "wizard", "content": "hi"}], None, "invalid chat messages: unknown variant `wizard`"),
        ("hello", None, "messages must be a list of message dicts"),
        ([[{"role": "user", "content": "hi"}], "x"], None, "messages[1] is not a non-empty list of message dicts"),
        ([{"role": "user", "content": "hi"}], {"temperature": 1}, "chat_template_kwargs has an unknown key"),
    ],
)
def test_bad_chat_input_is_a_clear_error(llm, messages, kwargs, message):
    with pytest.raises(DeepInferError) as err:
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs=kwargs)
    assert message in str(err.value)


def test_use_tqdm_shows_a_bar_over_finished_prompts(llm, capsys):
    llm.generate(["a", "b", "c"], GREEDY)
    shown = capsys.readouterr().err
    assert "Processed prompts" in shown and "3/3" in shown and "est. speed input" in shown
    llm.generate(["a", "b", "c"], GREEDY, use_tqdm=False)
    llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""
    llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert "1/1" in capsys.readouterr().err


def test_logprobs_come_in_vllm_shape(llm):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    [out] = llm.generate("Hello world", params, use_tqdm=False)
    sample = out.outputs[0]
    assert isinstance(sample.logprobs, list) and len(sample.logprobs) == 3
    for token, step, raw in zip(sample.token_ids, sample.logprobs, sample.token_logprobs):
        assert token in step and 2 <= len(step) <= 3 and all(isinstance(k, int) for k in step)
        assert all(isinstance(v, Logprob) for v in step.values())
        assert step[token].rank == 1 and step[token].logprob == pytest.approx(raw)  # greedy: the top token
        assert sorted(v.rank for v in step.values()) == [1, 2]
        assert step[token].decoded_token == llm.get_tokenizer().decode([token])
    assert sample.cumulative_logprob == pytest.approx(sum(sample.token_logprobs))
    prompt = out.prompt_logprobs
    assert prompt[0] is None and len(prompt) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], prompt[1:]):
        assert token in entry and entry[token].logprob <= 0


def test_n_samples_come_back_as_one_output_each(llm):
    [out] = llm.generate("Hi", SamplingParams(n=3, seed=1, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 3 for c in out.outputs)


def test_dtype_auto_is_float32_for_the_demo_model_on_cpu(llm, capsys):
    assert llm.backend.dtype is __import__("torch").float32
    bf16 = LLM(**{**SMALL, "progress": True}, dtype="bf16")  # vLLM's spellings work too
    assert str(bf16.backend.dtype) == "torch.bfloat16"
    assert "Building demo weights" in capsys.readouterr().err  # progress=True: a bar while it is built
    with pytest.raises(DeepInferError, match="backend cpu does not compute in float16; it supports float32, bfloat16"):
        LLM(**SMALL, dtype="half")
    with pytest.raises(DeepInferError, match="dtype 'int8' is not one of auto, float32"):
        LLM(**SMALL, dtype="int8")
    assert capsys.readouterr().err == ""  # progress=False: no bar


def test_dtype_auto_follows_the_checkpoint_on_cpu(tiny_checkpoint, tmp_path, capsys):
    folder = shutil.copytree(tiny_checkpoint, tmp_path / "bf16-ckpt")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    assert str(LLM(model=folder, **TINY).backend.dtype) == "torch.bfloat16"
    assert capsys.readouterr().err == ""
    assert str(LLM(model=tiny_checkpoint, **{**TINY, "progress": True}).backend.dtype) == "torch.float32"
    assert "Loading weights" in capsys.readouterr().err  # a bar while the checkpoint loads


def test_dtype_auto_on_an_accelerator():
    import torch

    from deepinfer_core.backend.types import BackendInfo, Capabilities
    from deepinfer_core.engine.dtypes import choose_dtype
    from deepinfer_core.kv.layout import CacheKind

    gpu = BackendInfo("gpu_x", "test", "gpu")
    both = Capabilities(dtypes=("float32", "bfloat16"), cache_kinds=(CacheKind.PAGED,))
    fp8 = {"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8"}}
    assert choose_dtype(None, gpu, both, {"torch_dtype": "float16"}) is torch.bfloat16
    assert choose_dtype(None, gpu, both, fp8) is torch.bfloat16
    assert choose_dtype(None, gpu, both, {"torch_dtype": "float32"}) is torch.float32
    only32 = Capabilities(dtypes=("float32",), cache_kinds=(CacheKind.PAGED,))
    assert choose_dtype(None, gpu, only32, {"torch_dtype": "bfloat16"}) is torch.float32  # the nearest it has


def test_kv_cache_dtype_must_be_one_the_backend_stores(llm):
    assert LLM(**SMALL, kv_cache_dtype="float32").backend.dtype is llm.backend.dtype  # = auto here
    with pytest.raises(DeepInferError, match="backend cpu does not store the KV cache in float8_e4m3fn; it stores"):
        LLM(**SMALL, kv_cache_dtype="fp8")
    with pytest.raises(DeepInferError, match="kv_cache_dtype 'int4' is not one of auto"):
        LLM(**SMALL, kv_cache_dtype="int4")
    with pytest.raises(DeepInferError, match="pass kv_cache_dtype='auto'"):
        LLM(**SMALL, kv_cache_dtype="bfloat16")  # the backend stores it, but not beside float32 compute


def test_gpu_memory_utilization_sizes_the_kv_cache_from_the_device_memory(llm):
    from deepinfer_core.kv.caches import block_bytes
    from deepinfer_core.model.config_v4 import DeepseekV4Config
    from deepinfer_core.model.deepseek_v4 import expected_weights_v4
    from deepinfer_core.model.demo import DEMO_CONFIG

    total = llm.backend.device.total_memory_bytes  # the cpu backend reports the machine's memory
    weights = 4 * sum(math.prod(s) for s in expected_weights_v4(DeepseekV4Config.from_hf(DEMO_CONFIG)).values())
    base = dict(accelerator="cpu", max_num_seqs=4, progress=False)
    fraction = (1.2 * weights + (16 << 20)) / total
    small = LLM(**base, gpu_memory_utilization=fraction)
    larger = LLM(**base, gpu_memory_utilization=fraction + (16 << 20) / total)
    per_block = block_bytes(llm.model.cache_specs, llm.engine.blocks.block_size)
    extra = larger.engine.blocks.num_blocks - small.engine.blocks.num_blocks
    assert abs(extra - (16 << 20) / per_block) <= 1  # 16 MiB more of the device: 16 MiB more KV cache
    with pytest.raises(DeepInferError, match="but the weights alone take .* raise gpu_memory_utilization"):
        LLM(**base, gpu_memory_utilization=0.9 * weights / total)
    with pytest.raises(DeepInferError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        LLM(**base, gpu_memory_utilization=1.5)
    explicit = LLM(**base, gpu_memory_utilization=fraction, kv_cache_memory_bytes=16 << 20)  # explicit bytes win
    assert explicit.engine.blocks.num_blocks == llm.engine.blocks.num_blocks


def test_seed_makes_seedless_requests_repeat():
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    prompts = ["Once upon a time", "In a galaxy"]

    def run(seed):
        return [o.outputs[0].token_ids for o in LLM(**SMALL, seed=seed).generate(prompts, params, use_tqdm=False)]

    first = run(1234)
    assert run(1234) == first
    assert run(4321) != first
    with pytest.raises(DeepInferError, match="seed must be an integer"):
        LLM(**SMALL, seed=-1)


def test_tokenizer_comes_from_another_folder(tiny_checkpoint, tmp_path):
    bare = LLM(model=tiny_checkpoint, **TINY)
    with pytest.raises(DeepInferError, match="has no tokenizer.json; pass tokenizer="):
        bare.get_tokenizer()
    with pytest.raises(DeepInferError, match="chat needs a tokenizer"):
        bare.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    with_tokenizer = LLM(model=tiny_checkpoint, tokenizer=demo_tokenizer_dir(), **TINY)
    assert with_tokenizer.get_tokenizer().decode(with_tokenizer.get_tokenizer().encode("Hello")) == "Hello"
    with pytest.raises(DeepInferError, match="has no tokenizer.json"):
        LLM(model=tiny_checkpoint, tokenizer=tmp_path, **TINY)
    with pytest.raises(DeepInferError, match="tokenizer path .* is not a directory"):
        LLM(model=tiny_checkpoint, tokenizer=tmp_path / "a" / "b" / "c", **TINY)
