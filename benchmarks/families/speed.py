"""One user's decode speed per model family: random-weight GGUF files of published ~1.5B shapes,
Q4_K_M by llama.cpp's own llama-quantize, served by Tessera and by llama.cpp server in turn.

Speed does not depend on the weights' values, so a random file of a published shape is a fair
speed test against llama.cpp on the same file. Each shape keeps its family's features (q/k norms,
post norms, soft-caps, partial rotary, NoPE layers, multipliers) and is scaled to about 1.5B
parameters by its layer count; every file carries qwen2.5-coder's tokenizer (151,936 tokens), so
the vocabulary, and with it the embedding and LM head, is Qwen's in every shape. The reference is
the packaged qwen2.5-coder-1.5b (Q4_K_M by its publisher): tok/s x parameters (in billions)
compared across families says whether a family runs as fast as its size allows.

    python benchmarks/families/speed.py --llama-cpp /work/peers/llama.cpp --out benchmarks/results/families

One server at a time; each run streams NUM_PROMPTS requests one after another (prompts of 50-80
words, 96-128 output tokens with ignore_eos) with `tessera bench serve`.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
VOCAB = 151936  # qwen2.5-coder's tokenizer, carried by every file
# family -> (published model, shape). Shapes scaled to ~1.5B parameters by their layer count.
SHAPES = {
    "llama": ("Llama-3.2-1B", dict(hidden=2048, layers=16, heads=32, kv=8, head_dim=64, ffn=8192)),
    "qwen3": ("Qwen3-1.7B", dict(hidden=2048, layers=28, heads=16, kv=8, head_dim=128, ffn=6144)),
    "gemma2": ("Gemma-2-2B (layers 26 -> 14)", dict(hidden=2304, layers=14, heads=8, kv=4, head_dim=256, ffn=9216)),
    "gemma3": ("Gemma-3-1B", dict(hidden=1152, layers=26, heads=4, kv=1, head_dim=256, ffn=6912)),
    "phi3": ("Phi-4-mini (layers 32 -> 12)", dict(hidden=3072, layers=12, heads=24, kv=8, head_dim=128, ffn=8192,
                                                 rotary=96)),
    "olmo2": ("OLMo-2-0425-1B", dict(hidden=2048, layers=16, heads=16, kv=16, head_dim=128, ffn=8192)),
    "granite": ("Granite-3.1-2B (layers 40 -> 20)", dict(hidden=2048, layers=20, heads=32, kv=8, head_dim=64,
                                                         ffn=8192)),
    "smollm3": ("SmolLM3-3B (layers 36 -> 16)", dict(hidden=2048, layers=16, heads=16, kv=4, head_dim=128,
                                                     ffn=11008)),
}
POST_NORMS = {"gemma2", "gemma3", "olmo2"}
UNTIED = {"olmo2"}  # its own LM head, as OLMo 2 ships (llama.cpp requires it there)
WORKLOAD = ["--prompt-words", "50:80", "--max-tokens", "96:128"]


def _tokenizer(writer, source: Path, pad_to: int | None = None) -> None:
    """qwen2.5-coder's vocabulary, merges and special ids, copied from its GGUF; with `pad_to`, the
    token list is padded to that many with unused [PADn] tokens (type 5), as llama.cpp's converter
    pads a vocabulary smaller than the model's embedding."""
    from gguf import GGUFReader

    r = GGUFReader(source)

    def strings(key):
        f = r.fields[key]
        return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]

    tokens = strings("tokenizer.ggml.tokens")
    types = [int(r.fields["tokenizer.ggml.token_type"].parts[i][0]) for i in r.fields["tokenizer.ggml.token_type"].data]
    pad = range(len(tokens), pad_to or len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in pad])
    writer.add_token_types(types + [5] * len(pad))
    writer.add_token_merges(strings("tokenizer.ggml.merges"))
    for key, add in (("tokenizer.ggml.eos_token_id", writer.add_eos_token_id),
                     ("tokenizer.ggml.bos_token_id", writer.add_bos_token_id),
                     ("tokenizer.ggml.padding_token_id", writer.add_pad_token_id)):
        if key in r.fields:
            add(int(r.fields[key].parts[-1][0]))
    writer.add_chat_template(bytes(r.fields["tokenizer.chat_template"].parts[-1]).decode())


def _tensors(family: str, s: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of every tensor, named as convert_hf_to_gguf.py names them."""
    h, q, kv, ff = s["hidden"], s["heads"] * s["head_dim"], s["kv"] * s["head_dim"], s["ffn"]
    out = [("token_embd.weight", (VOCAB, h)), ("output_norm.weight", (h,))]
    if family in UNTIED:
        out.append(("output.weight", (VOCAB, h)))
    for i in range(s["layers"]):
        b = f"blk.{i}."
        if family == "phi3":
            out += [(b + "attn_qkv.weight", (q + 2 * kv, h)), (b + "ffn_up.weight", (2 * ff, h))]
        else:
            out += [(b + "attn_q.weight", (q, h)), (b + "attn_k.weight", (kv, h)), (b + "attn_v.weight", (kv, h)),
                    (b + "ffn_gate.weight", (ff, h)), (b + "ffn_up.weight", (ff, h))]
        out += [(b + "attn_output.weight", (h, q)), (b + "ffn_down.weight", (h, ff))]
        if family != "olmo2":
            out.append((b + "attn_norm.weight", (h,)))
        if family in POST_NORMS:
            out += [(b + "post_attention_norm.weight", (h,)), (b + "post_ffw_norm.weight", (h,))]
            if family != "olmo2":
                out.append((b + "ffn_norm.weight", (h,)))
        else:
            out.append((b + "ffn_norm.weight", (h,)))
        if family in ("qwen3", "gemma3"):
            out += [(b + "attn_q_norm.weight", (s["head_dim"],)), (b + "attn_k_norm.weight", (s["head_dim"],))]
        if family == "olmo2":
            out += [(b + "attn_q_norm.weight", (q,)), (b + "attn_k_norm.weight", (kv,))]
    return out


def write_f16(family: str, path: Path, tokenizer_source: Path) -> int:
    """A random-weight F16 GGUF of the family's shape; returns its parameter count."""
    from gguf import GGUFWriter

    s = SHAPES[family][1]
    w = GGUFWriter(path, family)
    w.add_context_length(4096)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if family == "phi3":
        w.add_rope_dimension_count(s["rotary"])
        w.add_sliding_window(0)
    else:
        w.add_key_length(s["head_dim"])
        w.add_value_length(s["head_dim"])
        w.add_rope_dimension_count(s["head_dim"])
    if family in ("gemma2", "gemma3"):
        w.add_sliding_window(4096 if family == "gemma2" else 512)
    if family == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if family == "granite":
        w.add_attention_scale(0.015625)
        w.add_embedding_scale(12.0)
        w.add_residual_scale(0.22)
        w.add_logit_scale(8.0)
    w.add_file_type(1)  # MOSTLY_F16
    _tokenizer(w, tokenizer_source)
    rng = np.random.default_rng(0)
    params = 0
    for name, shape in _tensors(family, s):
        params += int(np.prod(shape))
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
        else:
            w.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return params


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"server not ready in {timeout} s; see {log}")


def run_summary(result: Path) -> dict:
    s = json.loads(result.read_text())["runs"][0]["summary"]
    return {"output_tokens_per_s": s["output_tokens_per_s"], "itl_p50_ms": 1000 * s["itl_s"]["p50"],
            "ttft_p50_s": s["ttft_s"]["p50"], "failed": s["failed"]}


def run_server(kind: str, gguf: Path, llama_cpp: Path, out: Path, label: str, prompts: int, port: int) -> dict:
    log = out / "logs" / f"{label}-{kind}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if kind == "tessera":
        cmd = [sys.executable, "-m", "tessera", "serve", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", label, "--max-model-len", "2048", "--num-threads", "2"]
    else:
        cmd = [str(llama_cpp / "build/bin/llama-server"), "-m", str(gguf), "--alias", label, "--host", "127.0.0.1",
               "--port", str(port), "-c", "2048", "-t", "2", "-tb", "2"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(url, proc, log)
        result = out / f"{label}-{kind}.json"
        with tempfile.TemporaryDirectory() as plots:  # the JSON is the result; the plots are not kept
            subprocess.run([sys.executable, "-m", "tessera", "bench", "serve", "--base-url", url, "--model", label,
                            "--label", kind, "--concurrency", "1", "--num-prompts", str(prompts), "--warmup", "1",
                            "--no-progress", "--output", str(result), "--plot-dir", plots, *WORKLOAD], check=True)
        return run_summary(result)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp checkout with llama-server and "
                    "llama-quantize built")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/families")
    ap.add_argument("--families", nargs="*", default=list(SHAPES))
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--summarize", action="store_true", help="only rebuild speed.json from the runs' JSON files")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.out / "speed.json", args.out)
        return
    from tessera.models.registry import ensure_model

    reference = ensure_model("qwen2.5-coder-1.5b", progress=False)
    args.out.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "speed.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary["host"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Model name:")[1] \
        .splitlines()[0].strip() if platform.system() == "Linux" else platform.processor()
    summary.setdefault("families", {})
    todo = ([] if "qwen2" in summary["families"] else ["qwen2"]) + args.families
    with tempfile.TemporaryDirectory() as tmp:
        for family in todo:
            if family == "qwen2":
                gguf, params, shape = reference, 1_543_714_304, "qwen2.5-coder-1.5b (packaged, real weights)"
            else:
                f16, gguf = Path(tmp) / f"{family}-f16.gguf", Path(tmp) / f"{family}-q4_k_m.gguf"
                params = write_f16(family, f16, reference)
                subprocess.run([str(args.llama_cpp / "build/bin/llama-quantize"), str(f16), str(gguf), "Q4_K_M", "2"],
                               check=True, capture_output=True)
                f16.unlink()
                shape = SHAPES[family][0]
            entry = {"shape": shape, "parameters": params, "gguf_bytes": gguf.stat().st_size}
            for kind in ("tessera", "llamacpp"):
                entry[kind] = run_server(kind, gguf, args.llama_cpp, args.out, family, args.num_prompts, args.port)
                print(family, kind, entry[kind], flush=True)
            entry["ratio_vs_llamacpp"] = entry["tessera"]["output_tokens_per_s"] / entry["llamacpp"]["output_tokens_per_s"]
            entry["tessera_tok_s_x_billion_params"] = entry["tessera"]["output_tokens_per_s"] * params / 1e9
            summary["families"][family] = entry
            summary_path.write_text(json.dumps(summary, indent=1) + "\n")
            if family != "qwen2":
                gguf.unlink()
    summarize(summary_path, args.out)


def summarize(summary_path: Path, out: Path) -> None:
    """Figures from each run's JSON; per family the ratio to llama.cpp on the same file, and tok/s x
    parameters against qwen2.5-coder-1.5b's (1.0: as fast as its size allows, by the reference)."""
    summary = json.loads(summary_path.read_text())
    for family, entry in summary["families"].items():
        for kind in ("tessera", "llamacpp"):
            entry[kind] = run_summary(out / f"{family}-{kind}.json")
        entry["ratio_vs_llamacpp"] = entry["tessera"]["output_tokens_per_s"] / entry["llamacpp"]["output_tokens_per_s"]
        entry["tessera_tok_s_x_billion_params"] = entry["tessera"]["output_tokens_per_s"] * entry["parameters"] / 1e9
        entry["llamacpp_tok_s_x_billion_params"] = entry["llamacpp"]["output_tokens_per_s"] * entry["parameters"] / 1e9
    ref = summary["families"]["qwen2"]
    for entry in summary["families"].values():
        entry["per_param_vs_qwen2"] = entry["tessera_tok_s_x_billion_params"] / ref["tessera_tok_s_x_billion_params"]
        entry["llamacpp_per_param_vs_qwen2"] = (entry["llamacpp_tok_s_x_billion_params"]
                                               / ref["llamacpp_tok_s_x_billion_params"])
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({f: (round(e["per_param_vs_qwen2"], 3), round(e["ratio_vs_llamacpp"], 3))
                      for f, e in summary["families"].items()}))


if __name__ == "__main__":
    main()
