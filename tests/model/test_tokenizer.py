"""Tokenizers agree with transformers; byte tokenizer round-trips; streaming never splits a char."""

from __future__ import annotations

import json
import os

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plaserve.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    load_tokenizer,
)

TEXTS = [
    "",
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "naïve café, Größe, 你好世界 🙂🚀 mixed\nlines\ttabs",
    "special tokens inline: <|im_start|>user\nhi<|im_end|></s>",
    "<s>bos in text",
]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi 🙂"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Tell me a story."},
]


@pytest.fixture(scope="module")
def hf_pair(tokenizer_dir: str):
    """(our HFTokenizer, transformers AutoTokenizer) for the same directory."""
    from transformers import AutoTokenizer

    return HFTokenizer(tokenizer_dir), AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_hf_encode_matches_transformers(hf_pair, text: str, add_special_tokens: bool) -> None:
    ours, ref = hf_pair
    expected = ref(text, add_special_tokens=add_special_tokens)["input_ids"]
    assert ours.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_hf_decode_matches_transformers(hf_pair, text: str, skip: bool) -> None:
    ours, ref = hf_pair
    ids = ref(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_hf_special_ids(hf_pair) -> None:
    ours, ref = hf_pair
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id == 0
    assert ours.eos_token_ids == [ref.eos_token_id]
    assert ours.bos_token == "<s>" and ours.eos_token == "</s>"


def test_eos_ids_merged_from_generation_config(llama_ckpt: str) -> None:
    tok = load_tokenizer(llama_ckpt)
    # </s> from tokenizer_config, <|im_end|> from generation_config.json's list.
    assert tok.eos_token_ids == [1, 3]


@pytest.mark.parametrize("form", ["jinja", "config", "config_list", "both"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tmp_path, make_tokenizer_files, form: str, add_generation_prompt: bool
) -> None:
    from transformers import AutoTokenizer

    directory = make_tokenizer_files(str(tmp_path), template_form=form)
    assert os.path.isfile(os.path.join(directory, "chat_template.jinja")) == (
        form in ("jinja", "both")
    )
    ours, ref = HFTokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert ours.has_chat_template

    rendered = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    expected = ref.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert rendered == expected
    # The ChatML template (not the alternative one) must have been picked in every form.
    assert rendered.startswith("<s><|im_start|>system\nYou are terse.<|im_end|>\n")
    # Chat prompts carry their own special tokens: encode without adding more.
    expected_ids = ref.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ours.encode(rendered, add_special_tokens=False) == expected_ids


def test_chat_template_raise_exception(tokenizer_dir: str) -> None:
    tok = HFTokenizer(tokenizer_dir)
    with pytest.raises(jinja2.TemplateError, match="Unsupported role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "42"}])


def test_no_chat_template_is_a_clear_error(tmp_path, make_tokenizer_files) -> None:
    tok = HFTokenizer(make_tokenizer_files(str(tmp_path), template_form="none"))
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_template_is_sandboxed(tokenizer_dir: str) -> None:
    tok = HFTokenizer(tokenizer_dir)
    tok.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(MESSAGES)


def test_add_bos_token_used_without_post_processor(tmp_path, make_tokenizer_files) -> None:
    # tokenizer.json without a post-processor: fall back to tokenizer_config's flags.
    directory = make_tokenizer_files(str(tmp_path))
    tj_path = os.path.join(directory, "tokenizer.json")
    with open(tj_path) as f:
        tj = json.load(f)
    tj["post_processor"] = None
    with open(tj_path, "w") as f:
        json.dump(tj, f)
    assert HFTokenizer(directory).encode("hi")[0] != 0
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["add_bos_token"] = True
    cfg["bos_token"] = {"content": "<s>", "special": True}  # dict form of a special token
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    tok = HFTokenizer(directory)
    assert tok.bos_token_id == 0
    assert tok.encode("hi")[0] == 0
    assert tok.encode("hi", add_special_tokens=False)[0] != 0


# ---------------------------------------------------------------- ByteTokenizer


def test_byte_tokenizer_basics() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer)
    assert tok.vocab_size == 512
    assert tok.encode("hé") == [256, ord("h"), 0xC3, 0xA9]
    assert tok.encode("hé", add_special_tokens=False) == [ord("h"), 0xC3, 0xA9]
    assert tok.decode([256, ord("h"), 257, 300, 0xC3, 0xA9]) == "hé"
    assert tok.decode([256, ord("h"), 257], skip_special_tokens=False) == "<|bos|>h<|eos|>"


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + text


def test_byte_tokenizer_chat_round_trip() -> None:
    tok = ByteTokenizer()
    rendered = tok.apply_chat_template(MESSAGES[:2])
    assert rendered == (
        "<|bos|><|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids[:2] == [tok.BOS, tok.IM_START]
    assert ids.count(tok.IM_END) == 2
    assert tok.decode(ids, skip_special_tokens=False) == rendered
    assert tok.decode(ids) == "system\nYou are terse.\nuser\nHi 🙂\nassistant\n"
    assert tok.IM_END in tok.eos_token_ids


# ---------------------------------------------------------------- IncrementalDetokenizer


def _stream(tok, ids, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == detok.text
    return deltas


def test_detokenizer_holds_back_partial_utf8_bytes() -> None:
    tok = ByteTokenizer()
    text = "a🙂b né 你好"
    deltas = _stream(tok, tok.encode(text, add_special_tokens=False))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # The emoji is 4 byte tokens: three empty deltas, then the whole character.
    assert deltas[1:5] == ["", "", "", "🙂"]


def test_detokenizer_hf_byte_level(hf_pair) -> None:
    ours, _ = hf_pair
    text = "Hi 🙂🚀 naïve 你好世界 done."
    ids = ours.encode(text, add_special_tokens=False)
    deltas = _stream(ours, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_detokenizer_with_prompt_context_and_specials(hf_pair) -> None:
    ours, _ = hf_pair
    prompt = ours.encode("Once upon a time")
    generated = ours.encode(" there was a 🚀", add_special_tokens=False) + [1]  # then </s>
    deltas = _stream(ours, generated, prompt_ids=prompt)
    assert "".join(deltas) == " there was a 🚀"
    assert deltas[-1] == ""  # eos is skipped


def test_detokenizer_flush_emits_incomplete_tail() -> None:
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ord("x")) == "x"
    assert detok.add(0xF0) == ""
    assert detok.flush() == "\ufffd"
    assert detok.text == "x\ufffd"
