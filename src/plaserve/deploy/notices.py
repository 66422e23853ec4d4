"""First-token notices from the ingress to the request router of the same process.

``plaserve route`` takes a request's cost off its worker's backlog at the first token; Ray tells a
request router only when a request is sent and when it completes, which for a streamed request is
after its whole decode. The ingress sees the first token (it holds each stream back until then), so
it passes the notice on: :func:`first_token` with the ``job_id`` it gave the call, which every
listener (each :class:`~plaserve.deploy.request_router.PlaRequestRouter` of the process) receives.
Listeners must be safe to call from any thread: the ingress and Ray's router run on different
event loops.
"""

from __future__ import annotations

import weakref
from typing import Callable

# Weak references: a router Ray has let go of (a redeploy, a new handle) stops listening.
_listeners: list[weakref.WeakMethod] = []


def listen(listener: Callable[[str], None]) -> None:
    """Call the bound method ``listener(job_id)`` on every first token, while its object lives."""
    _listeners.append(weakref.WeakMethod(listener))


def first_token(job_id: str) -> None:
    """The streamed request ``job_id`` got its first token."""
    for ref in list(_listeners):
        listener = ref()
        if listener is None:
            _listeners.remove(ref)
        else:
            listener(job_id)
