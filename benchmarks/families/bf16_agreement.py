"""bfloat16 top-1 agreement per family, Tessera against transformers, on the tiny random models.

Teacher-forced over random token sequences: at each position, does Tessera in bfloat16 pick the
token transformers picks in bfloat16, and in float32? transformers' own bfloat16 against its
float32 is printed beside: random tiny models have near-ties at the top that bfloat16 cannot
resolve, so that is the agreement any bfloat16 implementation can be expected to reach here.
"Clear" positions are those whose float32 margin over the runner-up exceeds 0.1.

    python benchmarks/families/bf16_agreement.py --out benchmarks/results/families/bf16_agreement.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import TINY_FAMILIES, build_tiny_hf_model  # noqa: E402

KINDS = ("llama", "qwen2", "gemma3", *TINY_FAMILIES)


def measure(kind: str, folder: Path, sequences: list[list[int]]) -> dict:
    from tessera.models.loader import forward_single, load_model

    model = build_tiny_hf_model(kind, folder)
    ours = load_model(folder, "bfloat16")
    counts = dict(ours_vs_theirs_bf16=0, ours_vs_f32=0, theirs_bf16_vs_f32=0, clear=0, ours_vs_f32_clear=0)
    total = 0
    for ids in sequences:
        x = torch.tensor([ids])
        with torch.no_grad():
            exact = model.float()(x).logits[0]
            theirs = model.to(torch.bfloat16)(x).logits[0].float().argmax(-1)
        got = forward_single(ours, ids).argmax(-1)
        want = exact.argmax(-1)
        top2 = exact.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 0.1
        counts["ours_vs_theirs_bf16"] += int((got == theirs).sum())
        counts["ours_vs_f32"] += int((got == want).sum())
        counts["theirs_bf16_vs_f32"] += int((theirs == want).sum())
        counts["clear"] += int(sure.sum())
        counts["ours_vs_f32_clear"] += int((got == want)[sure].sum())
        total += len(ids)
    return {"positions": total, **{k: round(v / (counts["clear"] if k.endswith("_clear") else total), 4)
                                   for k, v in counts.items() if k != "clear"}, "clear_positions": counts["clear"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/families/bf16_agreement.json")
    ap.add_argument("--sequences", type=int, default=8)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 300, (64,), generator=g).tolist() for _ in range(args.sequences)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            results[kind] = measure(kind, Path(tmp) / kind, sequences)
            print(kind, results[kind], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
