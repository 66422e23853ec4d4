"""OpenAI-compatible HTTP server: the engine on its own thread, Starlette routes, metrics, load report.

Start it with ``plaserve serve [MODEL_DIR]`` (:mod:`plaserve.server.cli`) or build the app yourself with
:func:`plaserve.server.app.build_app` around an :class:`plaserve.server.engine_loop.EngineLoop`.
"""
