"""Shared fixtures: a tiny trained tokenizer and tiny random-weight Hugging Face checkpoints.

Everything is built in-process with ``tokenizers`` and ``transformers`` (no downloads), once
per test session, in float32 so logits can be compared tightly against ``transformers``.

Checkpoint fixtures return the checkpoint directory as a ``str``. Each directory holds
``config.json``, ``generation_config.json`` (eos = ``[</s>, <|im_end|>]``), safetensors
weights and the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``).

Which rope keys end up in ``config.json``: ``transformers`` 5.x writes only
``"rope_parameters"`` (with ``rope_theta`` inside) and ``"dtype"``. Real Hub checkpoints
(written by 4.x) have top-level ``"rope_theta"``, ``"rope_scaling"`` and ``"torch_dtype"``.
To exercise both, ``llama_ckpt`` and ``mistral_ckpt`` are rewritten to the Hub form, and
``qwen2_ckpt`` keeps the 5.x form. ``transformers`` 5.x reads both forms identically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import pytest
import torch

# Keep CPU use modest on the shared 2-core machines.
torch.set_num_threads(min(2, torch.get_num_threads()))

SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(4)
MODEL_VOCAB_SIZE = 512  # tokenizer vocab (~400) rounded up, as real models pad theirs

# ChatML with a leading bos and a role check that exercises `raise_exception`.
CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A visibly different template, to tell which storage form was picked.
ALT_TEMPLATE = (
    "{% for message in messages %}[{{ message['role'] | upper }}] {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. A serving system batches requests together,
keeps a cache of keys and values for every token, and streams text back to the client as
soon as each new token is decoded. Hello world! How are you today? I am fine, thank you.
Once upon a time there was a small model that learned to tell short stories about cats,
dogs, trains and the weather. It was sunny, then it rained, and then the children played
outside until dinner. Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text too.
Les élèves écrivent des phrases en français. Größe, Straße, naïve café, 你好世界, 🙂🚀.
def main():\n    print("hello")\n    return 0\n
"""


@lru_cache(maxsize=1)
def _trained_tokenizer() -> Any:
    """Byte-level BPE (~400 ids) trained on the corpus above; any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line for line in _CORPUS.splitlines() if line] * 4, trainer)
    # Llama-style: the post-processor adds <s> for add_special_tokens=True.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [BOS_ID, EOS_ID, IM_START_ID, IM_END_ID]
    return tok


def make_tokenizer_files(directory: str, template_form: str = "jinja") -> str:
    """Write the test tokenizer into ``directory`` via ``transformers.save_pretrained``.

    ``template_form`` chooses how the chat template is stored:

    * ``"jinja"``: ``chat_template.jinja`` (what transformers 5.x writes).
    * ``"config"``: a string under ``chat_template`` in ``tokenizer_config.json`` (older form).
    * ``"config_list"``: a list of ``{name, template}`` in ``tokenizer_config.json`` with
      ``"default"`` = ChatML and ``"tool_use"`` = another template.
    * ``"both"``: ChatML in ``chat_template.jinja`` and a different template in
      ``tokenizer_config.json``; the .jinja file must win.
    * ``"none"``: no chat template at all.
    """
    from transformers import PreTrainedTokenizerFast

    os.makedirs(directory, exist_ok=True)
    template = None if template_form == "none" else CHATML_TEMPLATE
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_trained_tokenizer(),
        bos_token="<s>",
        eos_token="</s>",
        chat_template=template,
    )
    fast.save_pretrained(directory, save_jinja_files=template_form not in ("config", "config_list"))

    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if template_form == "config_list":
        config["chat_template"] = [
            {"name": "tool_use", "template": ALT_TEMPLATE},
            {"name": "default", "template": CHATML_TEMPLATE},
        ]
    elif template_form == "both":
        config["chat_template"] = ALT_TEMPLATE
    elif template_form not in ("jinja", "config", "none"):
        raise ValueError(f"unknown template_form {template_form!r}")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return directory


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter distinctive random values (HF zero-inits biases, ones-inits norms).

    std 0.1 keeps logits spread out (std ~1), so greedy argmax has clear winners and
    comparisons with transformers are not decided by float noise.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def _to_hub_rope_form(config_path: str) -> None:
    """Rewrite a transformers-5.x config.json the way 4.x-era Hub checkpoints store rope/dtype."""
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _build_checkpoint(
    directory: str,
    model_cls: Callable[..., torch.nn.Module],
    config: Any,
    seed: int,
    max_shard_size: str | None = None,
    hub_rope_form: bool = False,
) -> str:
    config.bos_token_id = BOS_ID
    config.eos_token_id = EOS_ID
    model = model_cls(config).to(torch.float32).eval()
    _randomize(model, seed)
    model.generation_config.bos_token_id = BOS_ID
    model.generation_config.eos_token_id = [EOS_ID, IM_END_ID]
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    if hub_rope_form:
        _to_hub_rope_form(os.path.join(directory, "config.json"))
    make_tokenizer_files(directory)
    return directory


@pytest.fixture(scope="session", name="make_tokenizer_files")
def make_tokenizer_files_fixture() -> Callable[..., str]:
    """The :func:`make_tokenizer_files` helper: ``(directory, template_form="jinja") -> directory``."""
    return make_tokenizer_files


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tokenizer-only directory (chat template in ``chat_template.jinja``)."""
    return make_tokenizer_files(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny Llama-3.1-style checkpoint, sharded (index.json + 6 shards), untied lm_head.

    config.json uses the Hub form: top-level ``rope_theta`` and ``rope_scaling`` with
    ``rope_type: "llama3"``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=MODEL_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        tie_word_embeddings=False,
    )
    return _build_checkpoint(
        str(tmp_path_factory.mktemp("llama")),
        LlamaForCausalLM,
        config,
        seed=1,
        max_shard_size="100KB",
        hub_rope_form=True,
    )


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny Qwen2 checkpoint: one ``model.safetensors``, nonzero q/k/v biases, tied embeddings
    (no ``lm_head.weight`` in the file). config.json is in the transformers-5.x form
    (``rope_parameters`` with ``rope_theta`` inside, ``dtype``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=MODEL_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    )
    return _build_checkpoint(
        str(tmp_path_factory.mktemp("qwen2")), Qwen2ForCausalLM, config, seed=2
    )


@pytest.fixture(scope="session")
def mistral_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny Mistral checkpoint (``sliding_window: null``), one file, untied, Hub rope form
    (``rope_theta`` 1e6, ``rope_scaling: null``)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=MODEL_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=1000000.0,
        sliding_window=None,
        tie_word_embeddings=False,
    )
    return _build_checkpoint(
        str(tmp_path_factory.mktemp("mistral")),
        MistralForCausalLM,
        config,
        seed=3,
        hub_rope_form=True,
    )


@pytest.fixture(scope="session")
def qwen2_bf16_prompts() -> list[list[int]]:
    """Prompts (5 to 600 tokens) on which ``qwen2_ckpt``'s greedy continuation of 16 tokens
    (transformers, bfloat16) never has its top two logits closer than 0.25: five times the largest
    logit difference between plaserve and transformers in bfloat16, so no near-tie decides a token and
    bfloat16 runs can be compared token for token. Found by searching seeds (on a random model, greedy
    steps with near-ties are common: the median top-2 margin is ~0.16)."""
    return [
        torch.randint(
            0, 300, (n,), generator=torch.Generator().manual_seed(1000 * n + seed)
        ).tolist()
        for n, seed in ((5, 28), (17, 14), (40, 15), (300, 20), (600, 14))
    ]


# --- tool-calling families: the tiny checkpoints with each family's special tokens and chat template --
TEMPLATES = os.path.join(os.path.dirname(__file__), "server", "templates")
# family: (base checkpoint fixture, template file (written from the family's published template),
# bos, eos, special tokens added, plain tokens added (Qwen2.5's <tool_call> tags are not special))
FAMILIES: dict[str, tuple[str, str, str | None, str, list[str], list[str]]] = {
    "hermes": (
        "qwen2_ckpt",
        "qwen2_5.jinja",  # Qwen/Qwen2.5-*-Instruct
        None,
        "<|im_end|>",
        ["<|endoftext|>"],
        ["<tool_call>", "</tool_call>"],
    ),
    "llama3_json": (
        "llama_ckpt",
        "llama3_1.jinja",  # meta-llama/Llama-3.1-8B-Instruct
        "<|begin_of_text|>",
        "<|eot_id|>",
        [
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        [],
    ),
    "mistral": (
        "mistral_ckpt",
        "mistral_v3.jinja",  # mistralai/Mistral-7B-Instruct-v0.3
        "<s>",
        "</s>",
        [
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        [],
    ),
}


def make_family_checkpoint(directory: str, base: str, family: str) -> str:
    """``base``'s weights (linked) with the test tokenizer extended by ``family``'s special tokens, its
    published chat template, and its end-of-turn token as the end of sequence."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    _, template_file, bos, eos, special, plain = FAMILIES[family]
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(base):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.symlink(os.path.join(base, name), os.path.join(directory, name))
    tok = Tokenizer.from_str(_trained_tokenizer().to_str())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    with open(os.path.join(TEMPLATES, template_file), encoding="utf-8") as f:
        template = f.read()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, chat_template=template
    )
    fast.save_pretrained(directory)
    eos_id = tok.token_to_id(eos)
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(base, name), encoding="utf-8") as f:
            config = json.load(f)
        config["eos_token_id"] = eos_id if name == "config.json" else [eos_id]
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    return directory


@pytest.fixture(scope="session")
def family_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """``family_ckpt(name)``: the checkpoint directory of a tool-calling family (built once)."""
    built: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in built:
            base = request.getfixturevalue(FAMILIES[family][0])
            built[family] = make_family_checkpoint(
                str(tmp_path_factory.mktemp(f"tools-{family}")), base, family
            )
        return built[family]

    return get


@pytest.fixture(scope="session")
def native_dtype() -> str:
    """The dtype ``--dtype auto`` picks on this CPU: bfloat16 where it multiplies bfloat16 in hardware,
    float32 elsewhere (where bfloat16 is emulated, hundreds of times slower: benchmark smoke tests
    that serve a model in it would take minutes)."""
    from plaserve.model.loader import resolve_dtype

    return str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
