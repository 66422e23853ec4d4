"""The router: a length-aware HTTP proxy in front of plaserve workers or any OpenAI-compatible server.

See docs/ROUTER.md. Modules: ``config`` (settings), ``costs`` (cost models and profiles), ``length``
(prompt length estimates), ``breaker`` (circuit breaker), ``workers`` (per-worker state and the
virtual backlog), ``health`` (health checks and ``/load`` polling), ``policies`` (routing decisions),
``pools`` (the short/long pool controller), ``metrics``, ``proxy`` (the HTTP app), ``cli`` and
``cluster`` (the ``route`` and ``cluster`` commands).
"""
