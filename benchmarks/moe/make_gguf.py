"""Random-weight GGUF files of two published MoE shapes, quantized as their published GGUFs are, for
the MoE speed comparison (benchmarks/moe/speed.py).

- gpt-oss-20b (llama.cpp arch `gpt-oss`): 24 layers, hidden 2880, 64 query / 8 KV heads of 64,
  32 experts top-4 of FFN 2880, vocabulary 201,088; sliding window 128 on every other layer
  starting with the first, YaRN rope (factor 32, theta 150,000, original context 4,096),
  attention sinks, attention, router and expert biases. Stored as ggml-org/gpt-oss-20b-GGUF's
  MXFP4 file is: experts MXFP4, the other matrices (embedding, LM head, attention) Q8_0, the
  router, norms, biases and sinks F32 (~12.1 GB).
- Qwen3-30B-A3B (arch `qwen3moe`): 48 layers, hidden 2048, 32 query / 4 KV heads of 128, q/k
  norms, 128 experts top-8 of FFN 768, vocabulary 151,936, untied LM head. Stored with the
  tensor types llama-quantize's Q4_K_M chooses for it (src/llama-quant.cpp): Q4_K, but Q6_K for
  the LM head and for attn_v and ffn_down_exps on the layers `use_more_bits` picks (24 of 48),
  the router and norms F32 (~18.5 GB). `--qwen-layers 24` halves it for a smaller machine.

The quantized blocks are written directly (random codes with scales chosen so weights have a
standard deviation of about 0.02, so activations stay finite): nothing is held in memory beyond
one tensor and no BF16 file is needed. Every file carries qwen2.5-coder's tokenizer (as
benchmarks/families/speed.py copies it); gpt-oss's token list is padded to its 201,088 with
unused [PADn] tokens, since its own o200k_harmony is not available offline and the vocabulary
size, not its tokens, is what sets the embedding and LM head cost. The chat template is
qwen2.5-coder's ChatML, not harmony: the benchmark measures raw generation.

    python benchmarks/moe/make_gguf.py --out /work/models-bench            # both files
    python benchmarks/moe/make_gguf.py --out /work/models-bench --only qwen3moe --qwen-layers 24

`--tiny` writes the same files (tensor types, biases, sinks, YaRN, sliding layers) at a few MB
(TINY's widths, two layers, the tokenizer's own vocabulary): enough to check that a server takes the
paths the real shapes take (its start-up log says whether decode steps run as the one-call C step)
without the 12-18 GB. `--tokenizer` copies another GGUF's tokenizer instead of qwen2.5-coder's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from families.speed import _tokenizer  # noqa: E402

GPT_OSS = dict(hidden=2880, layers=24, heads=64, kv=8, head_dim=64, experts=32, used=4, expert_ffn=2880,
               vocab=201088, context=131072, sliding_window=128, rope_theta=150000.0, yarn_factor=32.0,
               yarn_original_context=4096, rms_eps=1e-5)
QWEN3MOE = dict(hidden=2048, layers=48, heads=32, kv=4, head_dim=128, experts=128, used=8, expert_ffn=768,
                vocab=151936, context=40960, rope_theta=1000000.0, rms_eps=1e-6, ffn=6144)
# --tiny: the widths that keep every block format whole (K-quants' 256, MXFP4's 32) and the C step's
# head size (64); experts and top-k as published.
TINY = dict(hidden=256, layers=2, heads=4, kv=2, head_dim=64, expert_ffn=256)
FILES = {"gpt-oss": "gpt-oss-20b-shape-mxfp4.gguf", "qwen3moe": "qwen3-30b-a3b-shape-q4_k_m.gguf"}
PUBLISHED = {"gpt-oss": "openai/gpt-oss-20b (ggml-org/gpt-oss-20b-GGUF MXFP4 layout)",
             "qwen3moe": "Qwen/Qwen3-30B-A3B (llama-quantize Q4_K_M layout)"}


def qwen_file(layers: int) -> str:
    return FILES["qwen3moe"] if layers == QWEN3MOE["layers"] else f"qwen3-30b-a3b-shape-{layers}l-q4_k_m.gguf"


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's choice of the layers whose attn_v and ffn_down get Q6_K under Q4_K_M."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _fp16_bytes(x: float) -> np.ndarray:
    return np.array([x], dtype=np.float16).view(np.uint8)


def random_blocks(qtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random quantized blocks of a tensor of numpy `shape` (its last axis the row), in GGUF's byte
    shape; codes are random, each block's scale fixed so the weights' std is about 0.02."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert shape[-1] % block == 0, (qtype, shape)
    n_blocks = int(np.prod(shape)) // block
    b = np.frombuffer(bytearray(rng.bytes(n_blocks * size)), dtype=np.uint8).reshape(n_blocks, size)
    if qtype == "MXFP4":  # e (E8M0) then 16 bytes of 4-bit E2M1 codes: 2^(e-128) x doubled values
        b[:, 0] = 120
    elif qtype == "Q8_0":  # fp16 d then 32 int8: d x q
        b[:, 0:2] = _fp16_bytes(2.7e-4)
    elif qtype == "Q4_K":  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        b[:, 0:2] = _fp16_bytes(1e-4)
        b[:, 2:4] = _fp16_bytes(7.5e-4)  # d x sc x q - dmin x m centred for random sc, m, q
    elif qtype == "Q6_K":  # ql[128], qh[64], int8 scales[16], fp16 d: d x scale x (q - 32)
        b[:, 208:210] = _fp16_bytes(1.5e-5)
    else:
        raise ValueError(qtype)
    return b.reshape(*shape[:-1], shape[-1] // block * size)


def _dims(s: dict) -> tuple[int, ...]:
    """hidden, query width, KV width, experts, expert FFN, vocabulary."""
    return (s["hidden"], s["heads"] * s["head_dim"], s["kv"] * s["head_dim"], s["experts"], s["expert_ffn"],
            s["vocab"])


def gpt_oss_tensors(s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape, type) of every tensor, as llama.cpp's converter names them."""
    h, q, kv, e, f, v = _dims(s)
    out = [("token_embd.weight", (v, h), "Q8_0"), ("output_norm.weight", (h,), "F32"),
           ("output.weight", (v, h), "Q8_0")]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), "F32"), (b + "post_attention_norm.weight", (h,), "F32"),
                (b + "attn_q.weight", (q, h), "Q8_0"), (b + "attn_q.bias", (q,), "F32"),
                (b + "attn_k.weight", (kv, h), "Q8_0"), (b + "attn_k.bias", (kv,), "F32"),
                (b + "attn_v.weight", (kv, h), "Q8_0"), (b + "attn_v.bias", (kv,), "F32"),
                (b + "attn_output.weight", (h, q), "Q8_0"), (b + "attn_output.bias", (h,), "F32"),
                (b + "attn_sinks.weight", (s["heads"],), "F32"),
                (b + "ffn_gate_inp.weight", (e, h), "F32"), (b + "ffn_gate_inp.bias", (e,), "F32"),
                (b + "ffn_gate_exps.weight", (e, f, h), "MXFP4"), (b + "ffn_gate_exps.bias", (e, f), "F32"),
                (b + "ffn_up_exps.weight", (e, f, h), "MXFP4"), (b + "ffn_up_exps.bias", (e, f), "F32"),
                (b + "ffn_down_exps.weight", (e, h, f), "MXFP4"), (b + "ffn_down_exps.bias", (e, h), "F32")]
    return out


def qwen3moe_tensors(s: dict) -> list[tuple[str, tuple[int, ...], str]]:
    h, q, kv, e, f, v = _dims(s)
    out = [("token_embd.weight", (v, h), "Q4_K"), ("output_norm.weight", (h,), "F32"),
           ("output.weight", (v, h), "Q6_K")]
    for i in range(s["layers"]):
        b, more = f"blk.{i}.", "Q6_K" if use_more_bits(i, s["layers"]) else "Q4_K"
        out += [(b + "attn_norm.weight", (h,), "F32"), (b + "attn_q.weight", (q, h), "Q4_K"),
                (b + "attn_k.weight", (kv, h), "Q4_K"), (b + "attn_v.weight", (kv, h), more),
                (b + "attn_output.weight", (h, q), "Q4_K"),
                (b + "attn_q_norm.weight", (s["head_dim"],), "F32"), (b + "attn_k_norm.weight", (s["head_dim"],), "F32"),
                (b + "ffn_norm.weight", (h,), "F32"), (b + "ffn_gate_inp.weight", (e, h), "F32"),
                (b + "ffn_gate_exps.weight", (e, f, h), "Q4_K"), (b + "ffn_up_exps.weight", (e, f, h), "Q4_K"),
                (b + "ffn_down_exps.weight", (e, h, f), more)]
    return out


def _metadata(w, arch: str, s: dict) -> None:
    from gguf import LlamaFileType

    w.add_name(PUBLISHED[arch].split(" ")[0].split("/")[1] + " shape, random weights")
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s.get("ffn", s["expert_ffn"]))
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["rms_eps"])
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["used"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_expert_feed_forward_length(s["expert_ffn"])
    if arch == "gpt-oss":
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(s["yarn_factor"])
        w.add_rope_scaling_orig_ctx_len(s["yarn_original_context"])
        w.add_sliding_window(s["sliding_window"])
        w.add_file_type(LlamaFileType.MOSTLY_MXFP4_MOE)
    else:
        w.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)


def write(arch: str, path: Path, tokenizer_source: Path, layers: int | None = None, tiny: bool = False) -> dict:
    """Write the file; returns its shape, parameter count and bytes per tensor type. `tiny`: TINY's
    widths and the tokenizer's vocabulary."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    s = dict(GPT_OSS if arch == "gpt-oss" else QWEN3MOE)
    if tiny:
        s.update(TINY, vocab=len(GGUFReader(tokenizer_source).fields["tokenizer.ggml.tokens"].data))
    if layers:
        s["layers"] = layers
    tensors = (gpt_oss_tensors if arch == "gpt-oss" else qwen3moe_tensors)(s)
    rng = np.random.default_rng(0)
    tmp = path.with_suffix(".gguf.part")
    w = GGUFWriter(tmp, arch)
    _metadata(w, arch, s)
    _tokenizer(w, tokenizer_source, pad_to=s["vocab"])
    data = {}
    for name, shape, qtype in tensors:  # the header first: it lists every tensor's type and offset
        if qtype == "F32":
            if name.endswith("norm.weight"):
                data[name] = np.ones(shape, dtype=np.float32)
            else:  # biases, sinks, router: small random values
                data[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02)
            w.add_tensor_info(name, shape, np.dtype(np.float32), data[name].nbytes)
        else:
            byte_shape = random_blocks(qtype, (1, shape[-1]), rng).shape[-1:]
            byte_shape = (*shape[:-1], byte_shape[0])
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                              raw_dtype=GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    by_type: dict[str, int] = {}
    params = 0
    for n, (name, shape, qtype) in enumerate(tensors):
        arr = data.pop(name) if qtype == "F32" else random_blocks(qtype, shape, rng)
        w.write_tensor_data(arr)
        by_type[qtype] = by_type.get(qtype, 0) + arr.nbytes
        params += int(np.prod(shape))
        if n % 50 == 0:
            print(f"  {path.name}: {n}/{len(tensors)} tensors", flush=True)
    w.close()
    tmp.rename(path)
    return {"arch": arch, "shape": PUBLISHED[arch], "config": s, "parameters": params,
            "bytes_by_type": by_type, "gguf_bytes": path.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/work/models-bench"))
    ap.add_argument("--only", choices=list(FILES), nargs="*", default=list(FILES))
    ap.add_argument("--qwen-layers", type=int, default=QWEN3MOE["layers"],
                    help="Qwen3-30B-A3B's 48, or 24 where ~18.5 GB does not fit beside a KV cache")
    ap.add_argument("--force", action="store_true", help="rewrite a file that exists")
    ap.add_argument("--tiny", action="store_true", help="the same layouts at a few MB (see the module's help)")
    ap.add_argument("--tokenizer", type=Path, help="a GGUF whose tokenizer to copy (default: qwen2.5-coder-1.5b's)")
    args = ap.parse_args()
    from tessera.models.registry import ensure_model

    tokenizer_source = args.tokenizer or ensure_model("qwen2.5-coder-1.5b", progress=False)
    args.out.mkdir(parents=True, exist_ok=True)
    for arch in args.only:
        path = args.out / (FILES[arch] if arch == "gpt-oss" else qwen_file(args.qwen_layers))
        if args.tiny:
            path = path.with_name(path.name.replace("-shape", "-tiny-shape"))
        if path.exists() and not args.force:
            print(f"{path} exists ({path.stat().st_size / 1e9:.2f} GB)")
            continue
        layers = None if arch == "gpt-oss" or args.tiny else args.qwen_layers
        info = write(arch, path, tokenizer_source, layers, tiny=args.tiny)
        print(f"{path}: {info['gguf_bytes'] / 1e9:.2f} GB, {info['parameters'] / 1e9:.2f}B parameters, "
              f"{ {k: round(v / 1e9, 2) for k, v in info['bytes_by_type'].items()} } GB by type", flush=True)


if __name__ == "__main__":
    main()
