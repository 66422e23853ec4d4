"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, sampling_params)``."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from plaserve.config import EngineConfig
from plaserve.engine.engine import LLMEngine
from plaserve.model.tokenizer import Tokenizer
from plaserve.request import Request, RequestOutput, SamplingParams

Prompt = str | list[int]


class LLM:
    """Generate completions for a batch of prompts in one call.

    ``model`` is a local Hugging Face model directory or None for the embedded default model (random
    weights). Other keyword arguments are :class:`~plaserve.config.EngineConfig` fields.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # one prompt, text or token ids
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        # One engine request per choice; a prompt's later choices wait for its first one's prompt
        # blocks (see LLMEngine.add_request: one prefill for n choices).
        groups: list[list[Request]] = []
        for prompt, sp in zip(prompts, sampling_params):
            first, *rest = sp.choices()
            leader = self.engine.add_request(prompt, first)
            groups.append(
                [
                    leader,
                    *(self.engine.add_request(prompt, c, after=leader.request_id) for c in rest),
                ]
            )
        while self.engine.has_unfinished():
            self.engine.step_requests()  # outputs are built once, at the end
            if self.engine.last_batch is None:  # e.g. short requests inside their batch window
                self.engine.wait_for_work()
        return [self._output(group) for group in groups]

    @staticmethod
    def _output(group: list[Request]) -> RequestOutput:
        """One prompt's output, its choices' sequences in order (vLLM's shape for ``n`` > 1)."""
        out = RequestOutput.of(group[0])
        out.outputs = [
            dataclasses.replace(RequestOutput.of(r).outputs[0], index=j)
            for j, r in enumerate(group)
        ]
        return out

    def chat(
        self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None
    ) -> RequestOutput:
        """Generate one assistant turn for a conversation, using the tokenizer's chat template."""
        prompt = self.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(
            self.get_tokenizer().encode(prompt, add_special_tokens=False), sampling_params
        )[0]
