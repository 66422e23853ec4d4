"""Structured outputs: grammars compiled by llguidance, one matcher per constrained request, and the
per-step token masks of a batch's constrained rows (docs/STRUCTURED.md).

* :mod:`~plaserve.grammar.compile`: a request's :class:`plaserve.request.StructuredOutputs` (JSON
  schema, JSON object, regex, choice, Lark or GBNF grammar) to llguidance's grammar, and the checks
  that refuse what cannot compile;
* :mod:`~plaserve.grammar.matcher`: the tokenizer index llguidance computes masks over (built once per
  engine) and the per-request matcher, advanced with each sampled token;
* :mod:`~plaserve.grammar.masks`: a step's masks, computed on a worker thread while the forward pass
  runs, unpacked into the allowed-token rows the sampler applies.
"""

from plaserve.grammar.compile import GrammarError, check, grammar_of
from plaserve.grammar.masks import PendingMasks, start_masks
from plaserve.grammar.matcher import Grammars, Matcher

__all__ = [
    "GrammarError",
    "Grammars",
    "Matcher",
    "PendingMasks",
    "check",
    "grammar_of",
    "start_masks",
]
