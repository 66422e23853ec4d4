"""Length hints from a trusted gateway: a request header that states the prompt's token count, so
the router prices the request without tokenizing it.

An API gateway in front of the router (Envoy, an endpoint picker, a tenant's proxy that has
tokenized the prompt for billing or rate limits) may send ``x-prompt-tokens: N`` (one count per
prompt for a batched completion: ``N1,N2,...``). The router uses it instead of its own estimate
(:mod:`plaserve.router.length`) only when the request's **TCP peer** is in a trusted network,
``--trust-length-hints-from CIDR[,CIDR...]``; the default trusts no one. Why the peer address and not
a shared secret: in Kubernetes the gateway's pods have a known address range and only they reach the
router's Service (a NetworkPolicy makes that so), which is how proxies already decide whom to trust
(uvicorn's ``--forwarded-allow-ips``, Envoy's ``xff_num_trusted_hops``); a secret would have to be
distributed to the gateway and rotated, and Gateway API's ``RequestHeaderModifier`` can only set
fixed values, not a count. ``X-Forwarded-For`` is never consulted: any client can write it.

* A hint from an untrusted peer is ignored (the request is priced as if it had none) and counted.
* A malformed hint from a trusted peer (not a non-negative integer, or not one per prompt) is a 400
  naming the header: a trusted gateway that sends garbage is misconfigured, and pricing every request
  as one token would misroute silently.
* Once the worker's answer is in, the hint is compared with the answer's ``usage.prompt_tokens``
  (:func:`usage_prompt_tokens`) and the relative error ``(hint - actual) / actual`` is observed in a
  histogram, so a gateway whose counts drift (another tokenizer, no chat template) shows up.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from plaserve.router.length import completion_prompts

#: The header a gateway states the prompt's token count in.
HEADER = "x-prompt-tokens"

#: Buckets of the signed relative error: -1 (the hint said 0) to +10 (ten times too many).
ERROR_BUCKETS = (-0.75, -0.5, -0.25, -0.1, -0.05, -0.01, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class HintError(ValueError):
    """A trusted peer's hint that cannot be read; its message names the header."""


def parse_networks(spec: str | None) -> tuple[Network, ...]:
    """``"CIDR[,CIDR...]"`` (a bare address is a /32 or /128) as networks; ``None`` or ``""``: none.

    Raises ``ValueError`` naming the entry that is not a network."""
    out: list[Network] = []
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(ipaddress.ip_network(part, strict=False))
        except ValueError as e:
            raise ValueError(f"--trust-length-hints-from: {part!r} is not a CIDR: {e}") from None
    return tuple(out)


@dataclass(frozen=True)
class LengthHints:
    """Whose ``x-prompt-tokens`` headers are believed (module docstring)."""

    trusted: tuple[Network, ...] = ()

    @classmethod
    def from_spec(cls, spec: str | None) -> "LengthHints":
        """From the ``--trust-length-hints-from`` value."""
        return cls(parse_networks(spec))

    def trusts(self, peer: str | None) -> bool:
        """Whether a request from ``peer`` (its IP address) may state its length."""
        if not self.trusted or not peer:
            return False
        try:
            addr = ipaddress.ip_address(peer.split("%", 1)[0])
        except ValueError:  # a Unix socket's peer, say
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped  # a dual-stack socket reports IPv4 peers as ::ffff:a.b.c.d
        return any(addr in net for net in self.trusted)

    def read(
        self, headers: Mapping[str, str], peer: str | None, body: dict[str, Any], chat: bool
    ) -> tuple[str, tuple[int, ...] | None]:
        """``(outcome, tokens)`` of a request from ``peer`` with ``headers`` and a parsed ``body``
        (``chat``: a ``/v1/chat/completions`` body, one prompt): ``("absent", None)``,
        ``("untrusted", None)`` or ``("used", counts)``, one count per prompt. Raises
        :class:`HintError` for a trusted peer's malformed hint."""
        value = headers.get(HEADER)
        if value is None:
            return "absent", None
        if not self.trusts(peer):
            return "untrusted", None
        # A body the router cannot read prompts from takes one count; the worker will refuse it.
        prompts = 1 if chat else len(completion_prompts(body) or [None])
        parts = [p.strip() for p in value.split(",")]
        if not all(p.isascii() and p.isdigit() and len(p) <= 9 for p in parts):
            raise HintError(
                f"header {HEADER}: {value[:40]!r} is not a token count (one non-negative integer "
                "per prompt, comma-separated)"
            )
        if len(parts) != prompts:
            raise HintError(
                f"header {HEADER}: {len(parts)} count(s) for a request of {prompts} prompt(s)"
            )
        return "used", tuple(int(p) for p in parts)


def forwarded(headers: dict[str, str], used: bool) -> dict[str, str]:
    """``headers`` to send on: an unused hint is dropped, so that a router or gateway behind this one
    that trusts this one's address never takes an untrusted client's hint for this one's."""
    if used:
        return headers
    return {k: v for k, v in headers.items() if k.lower() != HEADER}


def relative_error(hint: int, actual: int) -> float:
    """``(hint - actual) / actual``, signed: positive when the hint overstates the prompt."""
    return (hint - actual) / max(actual, 1)


def usage_prompt_tokens(data: bytes) -> int | None:
    """``usage.prompt_tokens`` of an answer (the Responses and Messages APIs' ``usage.input_tokens``,
    in the Response or Message itself, or in its stream's ``response.completed`` or ``message_start``
    event): a JSON body, or the last event of
    a stream that has a usage (chat and completion streams carry one only with
    ``stream_options.include_usage``); None when there is none."""
    text = data.strip()
    if text.startswith(b"{"):
        candidates = [text]
    else:  # server-sent events: the usage chunk is the last one before [DONE]
        candidates = [
            line[5:].strip()
            for line in reversed(text.split(b"\n"))
            if line.startswith(b"data:")
            and (b'"prompt_tokens"' in line or b'"input_tokens"' in line)
        ][:1]
    for raw in candidates:
        try:
            obj = json.loads(raw)
            outer = obj.get("response") or obj.get("message")  # a Response's, a Message's
            usage = (outer if isinstance(outer, dict) else obj).get("usage")
        except (ValueError, AttributeError):
            return None
        if not isinstance(usage, dict):
            return None
        count = usage.get("prompt_tokens", usage.get("input_tokens"))
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return count
    return None


class HintCheck:
    """Compares one hinted request's count with the count its answer reports, once, at its end.

    ``observe`` gets the relative error (:func:`relative_error`); an answer without a usage is not
    measured. A stream is fed chunk by chunk; only its tail is kept (the usage chunk is the last)."""

    TAIL = 8192

    def __init__(self, hint: tuple[int, ...], observe: Callable[[float], None]) -> None:
        self.hint = sum(hint)
        self._observe = observe
        self._tail = b""
        self._done = False

    def feed(self, chunk: bytes) -> None:
        """A piece of a streamed answer. At its ``[DONE]`` the stream is measured, before that
        chunk is passed on: a client that has read the end then sees the measurement."""
        self._tail = (self._tail + chunk)[-self.TAIL :]
        if self._tail.rstrip().endswith(b"[DONE]"):
            self.done()

    def actual(self, count: int | None) -> None:
        """The answer's ``usage.prompt_tokens`` (None: it had none)."""
        if not self._done and isinstance(count, int) and not isinstance(count, bool):
            self._done = True
            self._observe(relative_error(self.hint, count))

    def done(self) -> None:
        """The stream ended (with or without ``[DONE]``): measure it from what was fed."""
        self.actual(usage_prompt_tokens(self._tail))


class HintMetrics:
    """What pricing did, for ``plaserve route`` (``prefix`` ``plaserve_router``) and the Ray ingress
    (``plaserve_ray``): tokens priced by method, hints by outcome, and the hints' relative error
    (signed buckets; prometheus_client exposes no ``_sum`` for a histogram with negative buckets)."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.priced_tokens = Counter(
            f"{prefix}_priced_prompt_tokens",
            "prompt tokens requests were priced at (what the routing cost is computed from), by "
            "estimate method",
            ["method"],
            registry=registry,
        )
        self.hints = Counter(
            f"{prefix}_length_hints",
            f"{HEADER} headers seen, by outcome: used (trusted peer), untrusted (ignored), "
            "malformed (400)",
            ["outcome"],
            registry=registry,
        )
        self.error = Histogram(
            f"{prefix}_length_hint_relative_error",
            f"(hint - usage.prompt_tokens) / usage.prompt_tokens of answers to requests priced by "
            f"{HEADER}",
            buckets=ERROR_BUCKETS,
            registry=registry,
        )
