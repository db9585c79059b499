"""`deepinfer generate` as the installed console script: the demo model end to end, and clean errors."""

from __future__ import annotations

import json
import re

import pytest


def test_generate_with_the_demo_model_is_seeded_and_streams(run_cli):
    args = ["generate", "--prompt", "Hello", "--max-tokens", "8", "--seed", "5", "--accelerator", "cpu"]
    first, second = run_cli(args), run_cli(args)
    assert first.returncode == 0, first.stderr
    assert "RANDOM weights" in first.stderr and "backend cpu" in first.stderr
    assert "8 tokens, finish reason length" in first.stderr
    assert first.stdout.strip() and first.stdout == second.stdout  # same seed, same text
    other = run_cli(["generate", "--prompt", "Hello", "--max-tokens", "8", "--seed", "6", "--accelerator", "cpu"])
    assert other.stdout != first.stdout


def test_generate_rejects_invalid_sampling_parameters(run_cli):
    result = run_cli(["generate", "--prompt", "Hello", "--temperature", "-1", "--top-p", "0"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "temperature must be >= 0" in result.stderr and "top_p must be in (0, 1]" in result.stderr


def test_generate_rejects_a_prompt_longer_than_the_context(run_cli):
    result = run_cli(["generate", "--prompt", "word " * 50, "--max-model-len", "16", "--accelerator", "cpu"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.search(r"the prompt has (\d+) tokens but the model's context is 16 tokens", result.stderr)


def test_generate_with_a_missing_model_path(run_cli, tmp_path):
    result = run_cli(["generate", "--prompt", "Hello", "--model", str(tmp_path / "nope"), "--accelerator", "cpu"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "is not a directory" in result.stderr


def test_batch_invariant_mode_needs_a_backend_that_offers_it(run_cli):
    refused = run_cli(["generate", "--prompt", "Hi", "--max-tokens", "2", "--accelerator", "cpu", "--batch-invariant"])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "cpu has no batch-invariant mode" in refused.stderr
    args = ["generate", "--prompt-token-ids", "5,6,7", "--max-tokens", "3", "--temperature", "0", "--batch-invariant"]
    served = run_cli([*args, "--accelerator", "rowwise_cpu"])
    assert served.returncode == 0, served.stderr
    assert "3 tokens" in served.stderr


def test_model_positional_config_file_and_dtype_aliases(run_cli, tiny_checkpoint, tmp_path):
    args = ["--prompt-token-ids", "5,6,7", "--max-tokens", "4", "--temperature", "0", "--accelerator", "cpu"]
    positional = run_cli(["generate", str(tiny_checkpoint), *args, "--dtype", "auto"])
    assert positional.returncode == 0, positional.stderr
    assert "4 tokens" in positional.stderr and len(positional.stdout.split()) == 4
    config = tmp_path / "generate.yaml"  # vLLM's config file: long flag names, dashes or underscores
    config.write_text(
        f"model: {tiny_checkpoint}\nprompt_token_ids: '5,6,7'\nmax-tokens: 4\ntemperature: 0\n"
        "accelerator: cpu\ndtype: float\n"
    )
    from_file = run_cli(["generate", "--config", str(config)])
    assert from_file.returncode == 0, from_file.stderr
    assert from_file.stdout == positional.stdout  # dtype auto is float32 for this float32 checkpoint on cpu
    overridden = run_cli(["generate", "--config", str(config), "--max_tokens", "2", "--dtype", "float32"])
    assert overridden.returncode == 0, overridden.stderr
    assert "2 tokens" in overridden.stderr and overridden.stdout.split() == positional.stdout.split()[:2]


def test_log_level_from_the_environment_and_the_flag(run_cli):
    args = ["generate", "--prompt", "Hi", "--max-tokens", "2", "--accelerator", "cpu"]
    quieter = run_cli(args, env={"DEEPINFER_LOGGING_LEVEL": "warning"})
    assert quieter.returncode == 0, quieter.stderr
    assert "RANDOM weights" in quieter.stderr  # a warning
    assert "finish reason" not in quieter.stderr and "backend cpu" not in quieter.stderr  # info lines
    quietest = run_cli([*args, "--log-level", "error"], env={"DEEPINFER_LOGGING_LEVEL": "info"})  # the flag wins
    assert quietest.returncode == 0 and quietest.stderr == "", quietest.stderr
    assert len(quietest.stdout.strip()) > 0


def test_a_bad_logging_level_in_the_environment_is_named(capsys, monkeypatch):
    from deepinfer_core.cli import main

    monkeypatch.setenv("DEEPINFER_LOGGING_LEVEL", "loud")
    assert main(["generate", "--prompt", "Hi"]) == 2
    assert capsys.readouterr().err == (
        "deepinfer: error: $DEEPINFER_LOGGING_LEVEL='loud' is not a log level; set it to one of "
        "debug, info, warning, error, critical\n"
    )


def test_generate_runs_a_deepseek_v41_checkpoint(run_cli):
    """A V4.1 folder (the reference-recorded engram_top1 fixture), its Engram tables in host memory: greedy
    output starts as the reference's."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer

    folder = Path(__file__).parent / "fixtures" / "deepseek_v41" / "engram_top1"
    reference = json.loads((folder / "reference.json").read_text())
    prompt, want = reference["prefill"]["prompts"][1], reference["greedy"]["tokens"][1]
    args = ["generate", str(folder), "--prompt-token-ids", ",".join(map(str, prompt)), "--max-tokens", "8"]
    args += ["--temperature", "0", "--ignore-eos", "--accelerator", "cpu", "--dtype", "float32"]
    result = run_cli([*args, "--engram-placement", "host", "--log-level", "info"])
    assert result.returncode == 0, result.stderr
    assert "8 tokens, finish reason length" in result.stderr
    assert "engram tables (0.00 GiB): host memory (engram_placement host)" in result.stderr
    assert result.stdout.startswith(Tokenizer.from_file(str(folder / "tokenizer.json")).decode(want[:2]))


def test_generate_takes_the_engram_placement_and_refuses_others(monkeypatch, capsys):
    from deepinfer_core.cli import main
    from deepinfer_core.engine import llm

    class Loaded(Exception):
        pass

    def loading(**kwargs):
        raise Loaded(kwargs["engram_placement"])

    monkeypatch.setattr(llm, "LLM", loading)
    with pytest.raises(SystemExit) as refused:  # argparse's refusal, before anything loads
        main(["generate", "--prompt", "Hi", "--engram-placement", "gpu"])
    assert refused.value.code == 2
    assert "argument --engram-placement: invalid choice: 'gpu'" in capsys.readouterr().err
    with pytest.raises(Loaded, match="^auto$"):
        main(["generate", "--prompt", "Hi"])
    with pytest.raises(Loaded, match="^host$"):
        main(["generate", "--prompt", "Hi", "--engram-placement", "host"])


def test_generate_holds_the_output_to_a_json_schema_file(run_cli, tmp_path):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "rank": {"type": "integer", "maximum": 9}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    (tmp_path / "s.json").write_text(json.dumps(schema))
    args = ["generate", "--prompt", "A city:", "--seed", "3", "--max-tokens", "40", "--accelerator", "cpu"]
    result = run_cli([*args, "--json-schema", str(tmp_path / "s.json"), "--log-level", "info"])
    assert result.returncode == 0, result.stderr
    value = json.loads(result.stdout)  # the demo model's random weights write JSON only under the constraint
    assert set(value) == {"city", "rank"} and len(value["city"]) <= 8 and type(value["rank"]) is int
    assert "finish reason stop" in result.stderr
    choice = run_cli(["generate", "--prompt", "Mood:", "--seed", "1", "--accelerator", "cpu", "--choice", "up",
                      "--choice", "down"])  # fmt: skip
    assert choice.returncode == 0 and choice.stdout.strip() in ("up", "down"), choice.stderr


def test_generate_names_a_bad_constraint(run_cli, tmp_path):
    missing = run_cli(["generate", "--prompt", "x", "--accelerator", "cpu", "--json-schema", str(tmp_path / "no")])
    assert missing.returncode == 2 and "--json-schema: cannot read" in missing.stderr, missing.stderr
    bad = run_cli(["generate", "--prompt", "x", "--accelerator", "cpu", "--regex", "a(b"])
    assert bad.returncode == 2 and "unclosed group" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    both = run_cli(["generate", "--prompt", "x", "--regex", "a", "--choice", "a"])
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
