"""The flags of `tessera serve`, for the `tessera` command and for tools that check or write
its command lines (`tessera tune` validates each trial's settings with them).

They live apart from tessera/cli.py so that such a tool needs only these flags, not the whole
command: the command also registers the tools' own subcommands, and importing it from them
would run in a circle.
"""
from __future__ import annotations

import argparse

from tessera.engine.args import add_engine_args, parse_size
from tessera.images import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES
from tessera.models import registry


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `tessera serve`; `ServingSpec.from_args` (tessera/server/config.py) reads them."""
    _server_flags(parser)
    _replica_flags(parser)
    _output_parsing_flags(parser)
    _network_flags(parser)
    _recording_flags(parser)
    add_engine_args(parser)


def serve_parser() -> argparse.ArgumentParser:
    """A parser of `tessera serve`'s flags alone (what `tessera serve ARGS` parses ARGS with)."""
    parser = argparse.ArgumentParser(prog="tessera serve")
    add_serve_args(parser)
    return parser


def _server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=registry.DEFAULT_MODEL,
                        help="registry name, .gguf path, model folder or hub id (default: %(default)s)")
    parser.add_argument("more_models", nargs="*", metavar="MODEL",
                        help="more models to serve from the same port, each in its own engine process, routed by "
                             "the request's `model`")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="model name the API reports and accepts (default: the model's name)")
    g.add_argument("--max-num-queued-requests", type=int, default=None,
                   help="requests waiting beyond this many get HTTP 429 (default: profile: chat-solo 8, "
                        "bursty 128, multi-agent 512)")
    g.add_argument("--max-queue-wait", type=float, default=None, metavar="SECONDS",
                   help="refuse (429 + Retry-After) a request whose forecast wait for its prompt is longer, so "
                        "admitted requests keep their latency at any load (default: off, only the queue bound)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM or Ctrl-C: seconds running requests get to finish while new ones get 503; "
                        "those still running then end with an error (default: %(default)s)")
    g.add_argument("--engine-step-timeout", type=float, default=120.0,
                   help="watchdog: an engine step running longer turns /health to 503 and refuses new "
                        "requests until it returns, 0 = off (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds after which a request is aborted, 0 = never; a request whose forecast queue wait "
                        "is already longer is refused at once with 429 (default: %(default)s)")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="OTLP/HTTP endpoint to export request traces to, e.g. http://127.0.0.1:4318/v1/traces "
                        "(default: tracing off)")
    g.add_argument("--config", default=None, metavar="TOML",
                   help="models to serve with per-model engine options, aliases, keep_alive and fallback rules "
                        "(see docs/serving.md, 'Several models'); replaces the MODEL arguments")
    g.add_argument("--preload", action="store_true",
                   help="with several models: load them all at start instead of on their first request")
    g.add_argument("--keep-alive", default=None, metavar="DURATION",
                   help="with several models: unload a model idle this long, e.g. 5m, 30s, 1h; -1 = never "
                        "(default: never)")
    g.add_argument("--max-loaded-models", type=int, default=None,
                   help="with several models: most loaded at once; loading another unloads the least recently "
                        "used idle one (default: no limit)")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own (ZeroMQ between them), as vLLM V1 does: HTTP, "
                        "JSON and tokenization never take the model's interpreter (measured: 1.09x output tok/s at "
                        "32 concurrent requests, the same latency alone), and a crash of the engine fails only its "
                        "requests and restarts it; --no-engine-process steps it on the server's main thread "
                        "(default: on; always on with several models)")


def _replica_flags(parser: argparse.ArgumentParser) -> None:
    """Replicas and Ray; --help lists the page, stored-response and log flags in this group too."""
    g = parser.add_argument_group("replicas and Ray (see docs/scale-out.md, 'Ray')")
    g.add_argument("--replicas", type=int, default=1,
                   help="engine replicas per model behind one API, each an engine core with its own KV cache; "
                        "requests are spread by --router-policy (default: %(default)s)")
    g.add_argument("--router-policy", default="prefix-aware", choices=["round-robin", "least-loaded", "prefix-aware"],
                   help="which replica takes a request: in turn, the one with the fewest unfinished requests, or "
                        "the one that last served the prompt's first blocks unless it is much busier than the "
                        "least-loaded (SGLang's cache-aware router) (default: %(default)s)")
    g.add_argument("--pd", default=None, metavar="prefill=N,decode=M",
                   help="prefill/decode disaggregation: N replicas compute prompts and hand their KV blocks to M "
                        "replicas that stream the answers, so long prompts do not stall running streams "
                        "(replaces --replicas)")
    g.add_argument("--ray", action="store_true",
                   help="place the replicas as Ray actors (on any node of the cluster, restarted by Ray when they "
                        "die) instead of local processes; needs `pip install tessera[ray]`")
    g.add_argument("--ray-address", default=None, metavar="auto|HOST:PORT",
                   help="Ray cluster to join (`auto`: the one `ray start` set up on this machine); default: start "
                        "a local Ray instance")
    g.add_argument("--ray-num-cpus-per-replica", type=float, default=1.0,
                   help="CPUs Ray reserves for each replica; also its torch thread count (default: %(default)s)")
    g.add_argument("--ray-num-gpus-per-replica", type=float, default=0.0,
                   help="GPUs Ray reserves for each replica (default: %(default)s)")
    g.add_argument("--ray-memory-per-replica", type=parse_size, default=None, metavar="SIZE",
                   help="memory Ray reserves for each replica, e.g. 6GiB, so it places no more replicas on a node "
                        "than fit (see `tessera size`) (default: no reservation)")
    g.add_argument("--ui", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the chat page at / and the live dashboard at /dashboard; --no-ui leaves only "
                        "the API (default: on)")
    g.add_argument("--max-stored-responses", type=int, default=1000, metavar="N",
                   help="responses of POST /v1/responses kept in memory for GET and previous_response_id, the "
                        "oldest dropped first (also at most 256 MiB of conversations); 0 stores none "
                        "(default: %(default)s)")
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="hosts whose http(s) image URLs a request may name (fetched without redirects, never from "
                        "a loopback, private or link-local address); default: none, images come as data: URLs")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="a directory whose files a request may name as file:// image URLs (default: none)")
    g.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS, metavar="N",
                   help="largest image a request may hold, in pixels (width x height), checked before it is "
                        "decoded (default: %(default)s)")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="image=N",
                   help=f"most images one prompt may hold (default: image={DEFAULT_MAX_IMAGES})")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity (default: %(default)s)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="do not log periodic engine statistics (throughput, KV cache use)")


def _output_parsing_flags(parser: argparse.ArgumentParser) -> None:
    from tessera.server.output_parsers import REASONING_PARSERS, TOOL_PARSERS

    g = parser.add_argument_group("tool calls and reasoning (see docs/apis.md, 'Tool calling')")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the syntax the model writes tool calls in, parsed and enforced by the grammar "
                        "(default: detected from the chat template; hermes when it shows none)")
    g.add_argument("--reasoning-parser", default=None, choices=[*sorted(REASONING_PARSERS), "none"],
                   help="return the model's <think> block (or gpt-oss's analysis channel) apart, as "
                        "reasoning_content (default: detected from the chat template: openai_gptoss for a harmony "
                        "one, with <|channel|>; qwen3 where it has Qwen3's enable_thinking switch, deepseek_r1 "
                        "where it opens <think>; none keeps the block in the content)")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template (a file, or the template text itself) used instead of the "
                        "model's own")


def _network_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("network access (see docs/security.md)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="a key clients must send (Authorization: Bearer KEY, or x-api-key), with every scope; "
                        "repeatable; also read from TESSERA_API_KEY")
    g.add_argument("--api-keys-file", default=None, metavar="TOML",
                   help="named keys stored as SHA-256, each with scopes (inference, metrics, admin), rpm, tpm, "
                        "max_concurrent and allowed models")
    g.add_argument("--metrics-require-key", action="store_true",
                   help="/metrics needs a key with the metrics scope (default: open, like /health)")
    g.add_argument("--log-requests", action="store_true",
                   help="log each request's prompt and sampling settings and its output (default: never)")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM); with --ssl-certfile, serve HTTPS")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM)")
    g.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGIN[,ORIGIN]",
                   help="origins whose pages may call the API from a browser (CORS), e.g. https://app.example; "
                        "* for any (default: same origin only)")
    g.add_argument("--timeout-header", type=float, default=10.0, metavar="SECONDS",
                   help="a request's line and headers must arrive within this, else 408 and close (default: %(default)s)")
    g.add_argument("--timeout-body", type=float, default=60.0, metavar="SECONDS",
                   help="a request's body must arrive within this after its headers (default: %(default)s)")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="SECONDS",
                   help="idle keep-alive connections close after this (default: %(default)s)")
    g.add_argument("--max-connections", type=int, default=1024,
                   help="open connections at most; past it a new one closes the longest-idle connection "
                        "(default: %(default)s)")


def _recording_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("traffic recording and SLO (see docs/operations.md, 'Record, replay and tune')")
    g.add_argument("--batch-store", default=None, metavar="PATH",
                   help="the SQLite file holding the Files and Batch API's files and batches, which outlive "
                        "restarts (default: $TESSERA_HOME/batches.sqlite3)")
    g.add_argument("--record-traffic", default=None, metavar="PATH",
                   help="append every request to this JSONL trace (arrival, endpoint, token counts, sampling "
                        "settings, prefix-block hashes, how it ended), written off the request path; replay it "
                        "with `tessera bench replay`, tune for it with `tessera tune` (default: off)")
    g.add_argument("--record-text", action="store_true",
                   help="with --record-traffic: also record prompt and output text (default: token counts "
                        "and hashes only)")
    g.add_argument("--record-traffic-max-size", type=parse_size, default=256 << 20, metavar="SIZE",
                   help="rotate the trace past this size: PATH becomes PATH.1, and so on (default: 256MiB)")
    g.add_argument("--record-traffic-keep", type=int, default=5, metavar="N",
                   help="rotated trace files kept (default: %(default)s)")
    g.add_argument("--slo", default=None, metavar="OBJECTIVES",
                   help="latency objectives live traffic is checked against on /v1/engine/live and the "
                        "dashboard, e.g. 'ttft_p95<=1s,itl_p50<=50ms' (default: a tuned --config's `slo`, else none)")
