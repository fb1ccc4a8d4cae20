"""Seeded random JSON schemas at temperature 0.8 against a running server: every answer must
finish (`stop`) and validate against its schema. The test suite runs one batch of these
(tests/server/test_structured_output_real.py); this is the full-size sweep.

    python benchmarks/schema_validity.py --url http://127.0.0.1:8000 --model qwen2.5-coder-0.5b \
        --cases 200 --out benchmarks/results/schema_validity/qwen05.json

Writes, per case: seed, finish reason, whether it validated (and the error if not), output tokens.
Exits 1 if any case failed.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai

from tessera.bench.datasets import random_json_schema
from tessera.bench.machine import machine_info


def ask(client: openai.OpenAI, model: str, seed: int, schema: dict, text: str) -> dict:
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Describe something as JSON with: {text}."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{seed}", "schema": schema, "strict": True}},
        temperature=0.8, seed=seed, max_tokens=400)
    choice = r.choices[0]
    result = {"seed": seed, "finish_reason": choice.finish_reason, "output_tokens": r.usage.completion_tokens,
              "valid": False, "error": None}
    try:
        jsonschema.validate(json.loads(choice.message.content), schema)
        result["valid"] = choice.finish_reason == "stop"
    except (ValueError, jsonschema.ValidationError) as exc:
        result["error"] = str(exc)[:300]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=15, help="seed of the schema generator (the test's is 15)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    cases = [random_json_schema(rng) for _ in range(args.cases)]
    client = openai.OpenAI(base_url=f"{args.url.rstrip('/')}/v1", api_key="unused", max_retries=0, timeout=3600)
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda i: ask(client, args.model, i, *cases[i]), range(args.cases)))
    failed = [r for r in results if not r["valid"]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "cases": args.cases, "generator_seed": args.seed,
                                    "failed": len(failed), "host": machine_info(), "results": results}, indent=1))
    print(f"{args.cases - len(failed)}/{args.cases} valid; {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
