"""``plaserve serve [MODEL_DIR]``: load the model, start the engine thread, serve HTTP with uvicorn.

Flags follow ``vllm serve`` where one exists (``--host``, ``--port``, ``--max-model-len``,
``--api-key``, ``--served-model-name``, ...).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from typing import TYPE_CHECKING

from plaserve.config import EngineConfig

if TYPE_CHECKING:
    from plaserve.engine.engine import LLMEngine
    from plaserve.server.app import HttpLimits

log = logging.getLogger(__name__)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's flags."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a local Hugging Face model directory or a hub model id such as "
        "Qwen/Qwen2.5-0.5B-Instruct (default: the embedded random-weight model)",
    )
    p.add_argument(
        "--revision",
        default=None,
        help="a hub model id's branch, tag or commit (default: main)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--policy",
        default=None,
        help="scheduling policy, e.g. pla, fcfs, spf (default: the engine's)",
    )
    p.add_argument(
        "--max-model-len", type=int, default=None, help="context length (prompt + output) in tokens"
    )
    p.add_argument(
        "--kv-cache-memory",
        default="auto",
        help="KV cache size: bytes, 2GiB, or a fraction like 0.5",
    )
    p.add_argument(
        "--cuda-graph-memory",
        default="1GiB",
        help="activation memory the captured (batch, bucket) grid may take: bytes, 1GiB, or a fraction",
    )
    p.add_argument(
        "--profile", default=None, help="calibrated cost profile (from `plaserve calibrate`)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (not on /health, /metrics)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="requests allowed to wait before new ones get 429 (default: unbounded)",
    )
    p.add_argument(
        "--engine-mode",
        choices=("auto", "process", "thread"),
        default="auto",
        help="where the engine runs: a process of its own (HTTP work never holds its GIL), a "
        "thread of the server's process (no pipe between them), or auto (default): a process "
        "where the CPUs outnumber torch's threads, a thread where the engine's threads take every "
        "CPU (docs/SERVER.md); prefill/decode roles always use a thread",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model name in the API (default: the directory name)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="requests holding KV blocks at once"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, else float32), float32, "
        "bfloat16 or float16",
    )
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the K/V of prompts' shared prefixes (default on; --no-enable-prefix-caching "
        "computes every prompt whole, as vllm serve's flag of that name)",
    )
    p.add_argument(
        "--no-online-refit",
        action="store_true",
        help="keep the cost model fixed (default: refit it on the engine's own prefill timings)",
    )
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="CPU: run the elementwise kernels eagerly (default: torch.compile them for large steps)",
    )
    p.add_argument(
        "--uvicorn-log-level", default="warning", help="uvicorn's log level (default warning)"
    )
    api = p.add_argument_group("chat and tools", "as in vllm serve")
    api.add_argument(
        "--generation-config",
        default="auto",
        help="auto (default): the model's generation_config.json sets the defaults of temperature, "
        "top_p, top_k, min_p, repetition_penalty and (as max_new_tokens) max_tokens; vllm: "
        "plaserve's own defaults; or a directory holding a generation_config.json",
    )
    api.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file to use instead of the tokenizer's",
    )
    api.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='answer tool_choice "auto" (the default with tools), reading calls with --tool-call-parser',
    )
    api.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls: hermes (Qwen2.5, Hermes, the embedded default), "
        "llama3_json (Llama 3.x), mistral",
    )
    api.add_argument(
        "--response-store-mib",
        type=float,
        default=64.0,
        help="MiB of finished /v1/responses answers kept for GET /v1/responses/{id} and "
        "previous_response_id, least recently used forgotten first (default 64; 0: keep none, "
        "as vLLM without VLLM_ENABLE_RESPONSES_API_STORE)",
    )
    http = p.add_argument_group(
        "HTTP limits", "what one connection or request may take of the server"
    )
    http.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a request's headers may take to arrive, from the connection opening or the "
        "request's first byte (default 10)",
    )
    # Longer than clients keep idle pooled connections (aiohttp 15 s, httpx 5 s): then the client, not
    # the server, closes an idle connection, and no request races a server-side close.
    http.add_argument(
        "--idle-timeout",
        type=float,
        default=20.0,
        help="seconds an idle keep-alive connection stays open between requests (default 20)",
    )
    http.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a request body may take to arrive once its headers are in (default 60)",
    )
    http.add_argument(
        "--max-body-size", default="32MiB", help="largest request body, e.g. 32MiB (default)"
    )
    http.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per streamed chunk (default 1: every token as it comes); the first token and "
        "the end go out at once. Larger values spend less CPU per token on the HTTP side (vLLM's "
        "flag; a request's own stream_interval may raise it)",
    )
    pd = p.add_argument_group(
        "prefill/decode disaggregation", "this worker's role in a PD cluster (docs/PD.md)"
    )
    pd.add_argument(
        "--pd-role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="prefill: prefill for remote decode workers (kv_transfer_params do_remote_decode); "
        "decode: decode requests whose KV a prefill worker computed (do_remote_prefill); both "
        "(default): whole requests, as a colocated worker",
    )
    pd.add_argument(
        "--kv-transfer-port",
        type=int,
        default=None,
        help="TCP port of the KV transfer service (default: any free port for the prefill and "
        "decode roles; none for both unless given)",
    )
    pd.add_argument(
        "--kv-transfer-host",
        default=None,
        help="address the transfer service advertises to decode workers (default --host)",
    )
    pd.add_argument(
        "--kv-transfer-ttl",
        type=float,
        default=30.0,
        help="seconds a prefill worker keeps a request's KV blocks for their pull (default 30)",
    )
    pd.add_argument(
        "--kv-pull-timeout",
        type=float,
        default=30.0,
        help="seconds a decode worker waits for each step of a pull (default 30)",
    )
    sched = p.add_argument_group(
        "scheduling",
        "the step policies' knobs (the length threshold and batch window come from --profile; "
        "pla's long chunk size from its cost model unless set)",
    )
    for flag, type_, help_ in SCHEDULER_FLAGS:
        sched.add_argument(flag, type=type_, default=None, help=help_)


# Scheduler knobs a deployment may want to set: (flag, type, help). Each sets the SchedulerConfig field
# of the flag's name; unset ones keep the engine's defaults.
SCHEDULER_FLAGS: list[tuple[str, type, str]] = [
    (
        "--max-num-batched-tokens",
        int,
        "fcfs/spf: tokens per step; pla: most tokens in one short batch",
    ),
    ("--ttft-slo-factor", float, "TTFT SLO = max(floor, factor x predicted isolated prefill time)"),
    ("--ttft-slo-floor", float, "the TTFT SLO's floor, in seconds"),
    ("--max-consecutive-short", int, "pla: short batches in a row while a long prefill waits (K)"),
    (
        "--long-chunk-size",
        int,
        "pla: prefill tokens per long chunk (default: from the cost model, as --profile's)",
    ),
    (
        "--late-yield",
        float,
        "pla: a request given up to keep others on time waits behind them for at most "
        "this many of its SLOs (higher: fewer SLO misses, a longer tail for the late ones)",
    ),
]


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` the flags describe (unset flags keep the engine's defaults)."""
    kwargs: dict[str, object] = {
        "model": args.model,
        "revision": args.revision,
        "kv_cache_memory": args.kv_cache_memory,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "cuda_graph_memory": args.cuda_graph_memory,
    }
    if args.policy is not None:
        kwargs["policy"] = args.policy
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.profile is not None:
        kwargs["profile"] = args.profile
    if args.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = args.enable_prefix_caching
    if args.no_online_refit:
        kwargs["online_refit"] = False
    if args.no_compile:
        kwargs["compile_min_tokens"] = None
    for flag, _, _ in SCHEDULER_FLAGS:
        name = flag[2:].replace("-", "_")
        value = getattr(args, name)
        if value is not None:
            if value < 0 or (value == 0 and name != "late_yield"):
                raise ValueError(f"{flag} must be positive (got {value})")
            kwargs[name] = value
    return EngineConfig.from_kwargs(**kwargs)


def http_limits_from_args(args: argparse.Namespace) -> "HttpLimits":
    """The :class:`HttpLimits` the flags describe; ValueError for a limit that is not positive (or a
    ``--stream-interval`` below 1)."""
    from plaserve.engine.kv_cache import parse_memory
    from plaserve.server.app import HttpLimits

    for flag in ("header_timeout", "idle_timeout", "body_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(
                f"--{flag.replace('_', '-')} must be positive (got {getattr(args, flag)})"
            )
    size = parse_memory(args.max_body_size, 0)
    if size < 1:
        raise ValueError(f"--max-body-size must be positive (got {args.max_body_size})")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be at least 1 (got {args.stream_interval})")
    return HttpLimits(max_body_bytes=size, body_timeout=args.body_timeout)


def tool_parser_from_args(args: argparse.Namespace) -> str | None:
    """The parser of ``tool_choice: "auto"`` answers (None: auto tool choice is off); ValueError for
    an unknown parser, or auto tool choice without one."""
    from plaserve.server.tool_parsers import PARSERS

    name = args.tool_call_parser
    if name is not None and name not in PARSERS:
        raise ValueError(f"unknown --tool-call-parser {name!r}; choose one of {', '.join(PARSERS)}")
    if args.enable_auto_tool_choice and name is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return name if args.enable_auto_tool_choice else None


def sampling_defaults_from_args(args: argparse.Namespace, model_dir: str | None) -> dict:
    """The request defaults ``--generation-config`` sets (see ``generation_config_defaults``)."""
    import json

    from plaserve.server.protocol import generation_config_defaults

    where = args.generation_config
    if where == "vllm":
        return {}
    if where == "auto":
        if model_dir is None:
            return {}
        where = model_dir
    elif not os.path.isdir(where):
        raise ValueError(f"--generation-config {where!r}: give auto, vllm or a directory")
    path = os.path.join(where, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        defaults = generation_config_defaults(json.load(f))
    if defaults:
        log.info("default sampling from %s: %s", path, defaults)
    return defaults


def read_chat_template(path: str | None) -> str | None:
    """The text of ``--chat-template FILE`` (None when not given)."""
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def engine_mode(requested: str, pd_worker: bool) -> str:
    """``"process"`` or ``"thread"``: where ``--engine-mode requested`` runs the engine.

    A process spares the engine the GIL the HTTP side holds, but costs a pipe hop and pickling per
    step, and its HTTP work can only run on a CPU the engine's threads leave free: with 1 of 2 CPUs
    left, streamed decode of 64 ran at 1.06x the offline time in a process against 1.24x on a thread;
    with both taken, at 1.66x against 1.28x (docs/BENCHMARKS.md). Prefill/decode workers hand KV
    blocks over on the engine's books in-process, so they always use a thread."""
    if pd_worker:
        if requested == "process":
            log.warning("--engine-mode process: prefill/decode roles run the engine on a thread")
        return "thread"
    if requested != "auto":
        return requested
    import torch

    return "process" if len(os.sched_getaffinity(0)) > torch.get_num_threads() else "thread"


def build_engine(args: argparse.Namespace, chat_template: str | None) -> LLMEngine:
    """The engine ``args`` describe, with ``chat_template`` (``--chat-template``) set, warmed up: run
    on the thread that will step it (see ``EngineLoop.on_own_thread``), in whichever process. What
    start-up built is then frozen out of the garbage collector's passes (``gc.freeze``)."""
    from plaserve.engine.engine import LLMEngine

    engine = LLMEngine(engine_config_from_args(args))
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    engine.warm_up()
    # The model, the tokenizer's tables and the imports live as long as the process: ~320,000 objects
    # the collector's full passes would walk every time (~130 ms with Qwen2.5-0.5B's tokenizer; one
    # stalled a served burst between two engine steps). vLLM freezes its engine core's heap alike.
    gc.collect()
    gc.freeze()
    return engine


def run_serve(args: argparse.Namespace) -> int:
    """Build the engine and serve until interrupted. Returns the process exit status: 0 after a normal
    shutdown, 1 when the engine failed beyond recovery (for a supervisor to restart the process), 2 for
    bad arguments."""
    import functools

    import uvicorn

    from plaserve.server.app import build_app
    from plaserve.server.connections import http_protocol
    from plaserve.server.engine_loop import EngineHandle, EngineLoop
    from plaserve.server.engine_process import EngineProcess

    if args.max_queue is not None and args.max_queue < 1:
        print("plaserve serve: --max-queue must be at least 1", file=sys.stderr)
        return 2
    if not args.response_store_mib >= 0:  # NaN too
        print("plaserve serve: --response-store-mib must be >= 0", file=sys.stderr)
        return 2
    fatal: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_fatal(error: BaseException) -> None:  # from the engine thread: ask uvicorn to shut down
        fatal.append(error)
        if server is not None:
            server.should_exit = True

    pd_worker = args.pd_role != "both" or args.kv_transfer_port is not None
    loop: EngineHandle
    try:
        limits = http_limits_from_args(args)
        tool_parser = tool_parser_from_args(args)
        chat_template = read_chat_template(args.chat_template)
        build = functools.partial(build_engine, args, chat_template)
        kwargs = dict(
            max_queue=args.max_queue, on_fatal=on_fatal, model_name=args.served_model_name
        )
        if engine_mode(args.engine_mode, pd_worker) == "thread":
            loop = EngineLoop.on_own_thread(build, **kwargs)
        else:
            loop = EngineProcess(build, log_level=logging.getLogger().level, **kwargs)
        sampling_defaults = sampling_defaults_from_args(args, loop.facts.model_path)
    except (ValueError, TypeError, OSError) as e:
        print(f"plaserve serve: {e}", file=sys.stderr)
        return 2
    facts = loop.facts
    name = loop.model_name
    pd = None
    if pd_worker:
        from plaserve.server.pd import PDWorker

        assert isinstance(loop, EngineLoop)

        pd = PDWorker(
            loop,
            args.pd_role,
            host=args.host,
            port=args.kv_transfer_port or 0,
            advertise_host=args.kv_transfer_host,
            ttl=args.kv_transfer_ttl,
            pull_timeout=args.kv_pull_timeout,
        )
    app = build_app(
        loop,
        served_model_name=name,
        api_key=args.api_key,
        http_limits=limits,
        pd=pd,
        tool_parser=tool_parser,
        sampling_defaults=sampling_defaults,
        response_store_bytes=int(args.response_store_mib * 2**20),
        stream_interval=args.stream_interval,
    )
    if facts.random_weights:
        print(
            f"NOTE: serving '{name}' with RANDOM WEIGHTS: its text is gibberish by design",
            file=sys.stderr,
        )
    print(
        f"plaserve: serving '{name}' on http://{args.host}:{args.port} (policy {loop.snapshot().load['policy']}, "
        f"max_model_len {facts.max_model_len}"
        + (f", pd role {args.pd_role}" if pd is not None else "")
        + ")",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        http=http_protocol(args.header_timeout),
        timeout_keep_alive=args.idle_timeout,
    )  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    server.run()
    if fatal:
        print(
            f"plaserve serve: the engine failed beyond recovery ({fatal[0]!r}); exiting with status 1",
            file=sys.stderr,
        )
        return 1
    return 0
