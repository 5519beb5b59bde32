"""Offline Qwen2.5 tokenizer: ids, dropped Qwen3 tokens, exact chat-template rendering."""
from __future__ import annotations

import pytest

from strata_jax.models.tokenizer import (QWEN25_CHAT_TEMPLATE, load_tokenizer, stop_token_ids)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_hello_world_ids(tok):
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    assert tok.decode([9707, 1879]) == "Hello world"


def test_think_tags_are_ordinary_bpe_pieces(tok):
    for tag in ("<think>", "</think>", "<tool_response>"):
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) >= 2, (tag, ids)
        assert max(ids) <= 151642, (tag, ids)  # ordinary BPE (special tokens start at 151643)
        assert tok.decode(ids) == tag
    assert len(tok) == 151665


def test_special_tokens_and_stop_ids(tok):
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == \
        [151643, 151644, 151645]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [151645]
    assert stop_token_ids(tok) == (151643, 151645)
    assert tok.pad_token_id == 151643


def test_chat_template_one_user_message_exact(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                    "helpful assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    with_system = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"},
         {"role": "assistant", "content": "A"}], tokenize=False)
    assert with_system == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ"
                           "<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n")


def test_chat_template_tools_branch_renders_as_qwen25_instruct_publishes_it(tok):
    # The published template's format hint is a Jinja string literal with doubled braces,
    # rendered literally; tool calls in assistant turns have single braces (a '...' literal).
    tool = {"type": "function", "function": {"name": "go", "parameters": {}}}
    msgs = [{"role": "user", "content": "Q"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"function": {"name": "go", "arguments": {"to": "north"}}}]},
            {"role": "tool", "content": "ok"}]
    text = tok.apply_chat_template(msgs, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "go", "parameters": {}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nQ<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "go", "arguments": {"to": "north"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_checkpoint_dir_without_template_gets_ours(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    import json
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (tmp_path / extra).unlink(missing_ok=True)
    again = load_tokenizer(str(tmp_path))
    assert again.chat_template == QWEN25_CHAT_TEMPLATE
    assert again.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(str(tmp_path / "nothing_here"))
