"""Each tiny random family model converted by llama.cpp's own convert_hf_to_gguf.py, loaded by
Tessera: the same greedy tokens as transformers on the Hugging Face folder.

The test suite writes its GGUF files with the gguf library as the converter lays them out
(tests/tiny_gguf.py); this checks that layout against the converter itself, which needs a
llama.cpp checkout (benchmarks/peers/setup_peers.sh makes one). The tiny tokenizer is not one of
the converter's known BPE pre-tokenizers, so its check is told "default" (the vocabulary's
handling is not what is tested here), and Gemma 2's and Phi-3's SentencePiece readers the BPE
one. Gemma's reference scales scores as llama.cpp does (1/sqrt(head_dim): its files do not
record query_pre_attn_scalar), and Gemma 3's has llama.cpp's layer pattern (5 sliding of 6).
The mixtures of experts too: Qwen3-MoE without dense layers (llama.cpp's qwen3moe has none),
gpt-oss's reference with llama.cpp's SwiGLU clamp (7.0; a GGUF records none).

    python benchmarks/families/convert_check.py --llama-cpp /work/peers/llama.cpp --out results.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import TINY_FAMILIES, TINY_MOE_FAMILIES, build_tiny_hf_model, tiny_hf_config  # noqa: E402

KINDS = ("llama", "qwen2", "gemma3", *TINY_FAMILIES, *TINY_MOE_FAMILIES)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 7, 120, 64, 33]


def convert(llama_cpp: Path, folder: Path, out: Path) -> None:
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import convert_hf_to_gguf as conv  # noqa: F401  (registers the model classes)
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    # Gemma 2's and Phi-3's converters read a SentencePiece vocabulary; the tiny one is BPE.
    from conversion import gemma, phi

    for cls in (gemma.Gemma2Model, phi.Phi3MiniModel):
        cls.set_vocab = base.TextModel._set_vocab_gpt2
    sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outfile", str(out), "--outtype", "f32"]
    conv.main()


def greedy_hf(model, n: int) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def greedy_tessera(path: Path, n: int) -> list[int]:
    from tessera.llm import LLM
    from tessera.sampling_params import SamplingParams

    llm = LLM(str(path), dtype="float32", max_model_len=128)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return out[0].outputs[0].token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("convert_check.json"))
    ap.add_argument("--kinds", nargs="*", default=list(KINDS))
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            folder = Path(tmp) / kind
            config = None
            if kind == "gemma3":  # its converter records no layer pattern: llama.cpp's, 5 sliding of 6
                config = tiny_hf_config(kind)
                config.num_hidden_layers = 6
                config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
            if kind == "qwen3_moe":
                config = tiny_hf_config(kind)
                config.mlp_only_layers = []
            model = build_tiny_hf_model(kind, folder, config=config)
            gguf = Path(tmp) / f"{kind}.gguf"
            try:
                convert(args.llama_cpp, folder, gguf)
            except Exception as exc:  # the converter's refusal is a result too
                results[kind] = {"converted": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            if kind.startswith("gemma"):  # a GGUF has no query_pre_attn_scalar: llama.cpp's 1/sqrt(head_dim)
                for layer in model.model.layers:
                    layer.self_attn.scaling = model.config.head_dim ** -0.5
            if kind == "gpt_oss":
                for m in model.modules():
                    if hasattr(m, "limit"):
                        m.limit = 7.0
            want = greedy_hf(model, 32)
            got = greedy_tessera(gguf, 32)
            results[kind] = {"converted": True, "identical": got == want, "transformers": want, "tessera": got}
            print(kind, "identical" if got == want else "DIFFERENT", flush=True)
    args.out.write_text(json.dumps({"host": platform.processor() or platform.machine(), "results": results},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
