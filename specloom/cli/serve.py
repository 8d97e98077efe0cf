"""`specloom serve`: the OpenAI-compatible server's lifecycle (listen, start-up check, drain on SIGTERM)."""

from __future__ import annotations

import logging
import sys
import threading

from ..errors import SpecloomError
from .args import positive_int, seconds, device_option, kv_cache_dtype_option


def add(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching and load-aware speculation")
    p.add_argument("model")
    p.add_argument("--speculative-config", default=None, help="JSON, as for generate")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--max-num-seqs", type=positive_int, default=16,
                    help="most sequences running at once (fewer when --memory-budget allows fewer)")
    p.add_argument("--memory-budget", default=None,
                    help="memory for target weights + drafter weights + KV caches, e.g. 4GiB; the KV pool gets "
                         "what the weights leave (default: room for --max-num-seqs sequences)")
    p.add_argument("--max-model-len", type=positive_int, default=2048,
                    help="longest prompt + completion per sequence (sizes each KV pool row)")
    kv_cache_dtype_option(p)
    p.add_argument("--speculation", default=None, choices=["load_aware", "fixed", "off"],
                    help="depth per step: from load and acceptance (default with a drafter), always "
                         "num_speculative_tokens, or never")
    p.add_argument("--max-queue", type=int, default=None,
                    help="requests that may wait for a free sequence slot before new ones get 429 "
                         "(default: 4 x the pool's sequences)")
    p.add_argument("--no-doctor", action="store_true",
                    help="skip the start-up check (`specloom doctor`'s quick part: fingerprints, a short acceptance "
                         "probe, predicted speed-up and verdict in the log)")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: MODEL)")
    p.add_argument("--metrics-require-key", action="store_true",
                    help="require the --api-key on /metrics too (default: /metrics is open, as vLLM's)")
    p.add_argument("--shutdown-timeout", type=seconds, default=30.0, metavar="SECONDS",
                    help="on SIGTERM: stop admitting, give the running requests this long to finish, then end the "
                         "rest with a 503 and exit 0 (default 30)")
    p.add_argument("--special-tokens-in-input", action="store_true",
                    help="parse special-token strings (e.g. <|im_end|>) in message content and completions prompts "
                         "as special tokens (default: plain text, so content cannot forge a chat turn)")
    p.add_argument("--head-timeout", type=seconds, default=10.0, metavar="SECONDS",
                    help="close a connection that has not sent a complete request head within this long of opening "
                         "(or of its last response): idle and slowloris sockets do not pile up (default 10)")
    p.add_argument("--max-connections", type=positive_int, default=512,
                    help="concurrent connections and requests before new ones get a 503 at once (default 512)")
    device_option(p)
    p.set_defaults(run=run)


def run(args) -> int:
    import signal

    import uvicorn

    from ..engine import load
    from ..kv_quant import kv_dtype_arg
    from ..scheduler import parse_size
    from ..serving.api import Server
    from ..serving.app import build_app
    from ..serving.lifecycle import Lifecycle
    from ..serving.http_limits import config as http_config
    from ..serving.listen import listen

    logging.getLogger("specloom.serve").setLevel(logging.INFO)  # admission, pool size, load-aware depth changes
    budget = parse_size(args.memory_budget)  # checked before the model loads
    if args.metrics_require_key and not args.api_key:
        raise SpecloomError("--metrics-require-key needs --api-key (the key /metrics would require)")
    sock = listen(args.host, args.port)  # so is the port: taken or out of range is one line, at once
    port = sock.getsockname()[1]
    # HTTP first, in a thread (/health: 503 "starting" while the model loads); the scheduler (all model work) in
    # the main thread: see BatchScheduler's `start`.
    life = Lifecycle()
    uv = uvicorn.Server(http_config(build_app(life), args.head_timeout, args.max_connections, host=args.host,
                                    port=port, log_level="warning", timeout_graceful_shutdown=10))
    uv.install_signal_handlers = lambda: None  # signals stay with the main thread

    def http():
        uv.run(sockets=[sock])
        if life.server is not None:  # the HTTP server stopped: stop scheduling too
            life.server.scheduler.close()

    http_thread = threading.Thread(target=http, daemon=True)
    http_thread.start()

    def on_sigterm(signum, frame):
        if life.state != "ready":  # still starting (nothing to finish), or a second SIGTERM: stop at once
            raise KeyboardInterrupt
        print(f"specloom: SIGTERM: draining -- no new requests; the running ones get up to {args.shutdown_timeout:g} "
              "s to finish", file=sys.stderr, flush=True)
        threading.Thread(target=life.drain, args=(args.shutdown_timeout,), daemon=True).start()  # not under a lock

    signal.signal(signal.SIGTERM, on_sigterm)  # a service manager's stop: drain, then exit 0
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C: stop at once
    try:
        engine = load(args.model, args.speculative_config, dtype=args.dtype, max_model_len=args.max_model_len,
                      device=args.device)
        kv_dtype = kv_dtype_arg(args.kv_dtype)
        expected_tau = _startup_doctor(engine) if engine.drafter is not None and not args.no_doctor else None
        server = Server(engine, args.served_model_name or args.model, args.api_key, args.max_num_seqs, budget,
                        args.speculation, max_queue=args.max_queue, kv_dtype=kv_dtype, start=False,
                        special_tokens_in_input=args.special_tokens_in_input,
                        metrics_require_key=args.metrics_require_key, expected_tau=expected_tau)
        life.ready(server)
        m = server.memory
        mib = 2 ** 20
        print(f"specloom: serving {server.model_name} on http://{args.host}:{port}/v1 -- {m['rows']} sequences of "
              f"{m['row_tokens']} tokens; target weights {m['target_weights'] / mib:.0f} MiB, drafter weights "
              f"{m['drafter_weights'] / mib:.0f} MiB, KV pool {server.scheduler.pool.nbytes / mib:.0f} MiB; "
              f"speculation {server.scheduler.policy.mode}", file=sys.stderr, flush=True)
        server.scheduler.run()  # returns when drained (or the HTTP server stopped)
    except KeyboardInterrupt:
        pass
    finally:
        uv.should_exit = True  # uvicorn finishes the responses in flight (at most 10 s), then closes
    http_thread.join(timeout=15)
    return 0


def _startup_doctor(engine) -> float | None:
    """`specloom doctor`'s quick part before serving (two short prompts, no plain run): its findings and verdict
    in the log; its tau becomes the live acceptance monitor's start-up figure, except for a mismatched drafter
    (the monitor then compares with the manifest's figure, and says that it runs degraded)."""
    from ..doctor import run_doctor

    report = run_doctor(engine, quick=True)
    for line in report.lines():
        print(f"specloom: doctor: {line}", file=sys.stderr, flush=True)
    return report.tau if report.verdict != "mismatch" else None
