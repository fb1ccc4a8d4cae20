"""Speculation that never loses: every prompt of a varied set, with speculation off and on, on one
server (the same process and weights: a request opts out with `"speculative": false`), prefix
caching off so that both ways compute the prompt.

    flock /tmp/tessera-bench.lock .venv/bin/python benchmarks/spec_adaptive.py --model qwen2.5-coder-1.5b

26 prompts: 8 code edits whose answer copies the code it is given, 6 open chat, 6 translations,
6 summaries. One request at a time, greedy, the same max_tokens both ways; each prompt runs off
then on, or on then off (alternating, so drift favours neither; `--repeats` rounds, the order
reversed each round, the fastest run of each way counting: the machine's other work only adds
time), after an untimed one-token run that pays its first-use costs. Per prompt: seconds, output
tokens, the ratio (seconds off / seconds on: above 1 speculation won), the acceptance counters
from /metrics, and whether the two answers are identical. The summary has the least ratio, the
code edits' overall ratio (their summed seconds off / on) and every prompt's. Writes
benchmarks/results/speculative/adaptive-<model>.json with the host's CPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tessera.bench.client import stop_server, wait_for_health
from tessera.hostinfo import cpu_model_name

REPO = Path(__file__).resolve().parent.parent
# No cache of earlier outputs: each prompt runs more than once, and a repeat would find its own
# earlier answer there (a gain no new prompt would see).
DEFAULT_SPEC = '{"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 0}'

_CODE = {
    "py_stats": '''def summarize(values):
    total = 0
    count = 0
    for v in values:
        total = total + v
        count = count + 1
    mean = total / count
    squares = 0
    for v in values:
        squares = squares + (v - mean) * (v - mean)
    variance = squares / count
    return {"total": total, "count": count, "mean": mean, "variance": variance}
''',
    "py_inventory": '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity):
        if name in self.items:
            self.items[name] = self.items[name] + quantity
        else:
            self.items[name] = quantity

    def remove(self, name, quantity):
        if name not in self.items:
            raise KeyError(name)
        self.items[name] = self.items[name] - quantity
        if self.items[name] <= 0:
            del self.items[name]

    def count(self, name):
        return self.items.get(name, 0)
''',
    "js_fetch": '''function loadUsers(url, callback) {
  fetch(url)
    .then(function (response) {
      return response.json();
    })
    .then(function (data) {
      var users = [];
      for (var i = 0; i < data.length; i++) {
        users.push({ id: data[i].id, name: data[i].name, email: data[i].email });
      }
      callback(null, users);
    })
    .catch(function (err) {
      callback(err, null);
    });
}
''',
    "py_parse": '''def parse_config(path):
    result = {}
    f = open(path)
    for line in f.readlines():
        line = line.strip()
        if line == "" or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        result[key.strip()] = value.strip()
    f.close()
    return result
''',
    "go_sum": '''package main

import "fmt"

func sumEven(numbers []int) int {
	total := 0
	for i := 0; i < len(numbers); i++ {
		if numbers[i]%2 == 0 {
			total += numbers[i]
		}
	}
	return total
}

func main() {
	numbers := []int{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	fmt.Println(sumEven(numbers))
}
''',
    "py_matrix": '''def multiply(a, b):
    rows = len(a)
    cols = len(b[0])
    inner = len(b)
    result = []
    for i in range(rows):
        row = []
        for j in range(cols):
            value = 0
            for k in range(inner):
                value += a[i][k] * b[k][j]
            row.append(value)
        result.append(row)
    return result
''',
    "ts_cart": '''interface Item {
  name: string;
  price: number;
  quantity: number;
}

function cartTotal(items: Item[]): number {
  let total = 0;
  for (const item of items) {
    total += item.price * item.quantity;
  }
  return total;
}

function cheapest(items: Item[]): Item | undefined {
  let best: Item | undefined = undefined;
  for (const item of items) {
    if (best === undefined || item.price < best.price) {
      best = item;
    }
  }
  return best;
}
''',
    "sql_report": '''SELECT customers.id, customers.name, COUNT(orders.id) AS order_count, SUM(orders.total) AS revenue
FROM customers
LEFT JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01'
GROUP BY customers.id, customers.name
ORDER BY revenue DESC
LIMIT 20;
''',
}

CODE_EDITS = [
    ("py_stats", "Rename the variable `count` to `n` everywhere in this function. Reply with the whole function only."),
    ("py_inventory", "Add a method `total(self)` returning the sum of all quantities to this class. Reply with the "
                     "whole class only."),
    ("js_fetch", "Replace every `var` with `const` or `let` as appropriate in this code. Reply with the whole code only."),
    ("py_parse", "Change this function to open the file with a `with` statement. Reply with the whole function only."),
    ("go_sum", "Rename the function `sumEven` to `sumOfEvens` in this program. Reply with the whole program only."),
    ("py_matrix", "Add type hints (lists of lists of floats) to this function. Reply with the whole function only."),
    ("ts_cart", "Rename the interface `Item` to `CartItem` everywhere in this code. Reply with the whole code only."),
    ("sql_report", "Change the LIMIT to 50 and also select customers.email. Reply with the whole query only."),
]

CHAT = [
    "What are three good habits for writing maintainable software? Answer in a short paragraph.",
    "Explain why the sky is blue to a ten-year-old.",
    "Suggest a name for a small bakery that specialises in sourdough, and say why.",
    "What is the difference between a process and a thread?",
    "Give me a short plan for learning to play the guitar in three months.",
    "Why do cats purr? Keep it brief.",
]

TRANSLATE = [
    ("French", "The meeting has been moved to Thursday afternoon because the projector in the main room is "
               "broken. Please bring your laptops and the printed agenda."),
    ("German", "Our new library opens next Monday. Children can borrow up to five books at a time, and the "
               "reading room stays open until eight in the evening."),
    ("Spanish", "Thank you for your order. Your package left our warehouse this morning and should arrive within "
                "three working days. You can follow it with the link below."),
    ("Italian", "The museum is closed on Mondays. Tickets are cheaper for students, and guided tours in English "
                "start every hour from ten to four."),
    ("Portuguese", "Remember to water the plants twice a week while I am away, and please keep the windows "
                   "closed when it rains."),
    ("Dutch", "The train to Amsterdam leaves from platform four. Passengers with bicycles should board at the "
              "front of the train."),
]

SUMMARIES = [
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light energy into "
    "chemical energy. Using sunlight, they turn carbon dioxide and water into glucose and oxygen. The glucose "
    "fuels the organism's growth, while the oxygen is released into the air. The process takes place mainly in "
    "the chloroplasts, which contain the pigment chlorophyll, and it is the basis of nearly every food chain.",
    "The printing press, developed by Johannes Gutenberg around 1440, used movable metal type to reproduce "
    "texts far faster than copying by hand. Books became cheaper and more common, literacy spread, and ideas "
    "travelled across Europe within years instead of decades. Historians link it to the Reformation, the "
    "Scientific Revolution and the rise of newspapers.",
    "Remote work grew quickly after 2020. Surveys show that many employees value the time saved on commuting "
    "and the flexibility to organise their day, while managers worry about collaboration and training new "
    "staff. Many companies have settled on hybrid arrangements, with two or three days a week in the office.",
    "Honeybees communicate the location of food through the waggle dance. A forager returning to the hive "
    "moves in a figure-eight pattern; the angle of the straight run relative to vertical indicates the "
    "direction of the food relative to the sun, and the duration of the run indicates the distance.",
    "A budget is a plan for how to spend and save money. Listing income and fixed costs first shows how much "
    "is left for everything else. Tracking spending for a month often reveals small, regular purchases that "
    "add up, and setting aside savings at the start of the month makes them more likely to happen.",
    "Volcanoes form where magma from inside the Earth reaches the surface. Most are found along the edges of "
    "tectonic plates, where plates pull apart or one slides beneath another. Eruptions can be explosive, "
    "throwing ash high into the atmosphere, or effusive, with lava flowing steadily from vents.",
]


def prompt_set() -> list[dict[str, str]]:
    """Every prompt with its kind and a name."""
    out = [{"kind": "code_edit", "name": name, "content": f"{task}\n\n```\n{_CODE[name]}```"}
           for name, task in CODE_EDITS]
    out += [{"kind": "chat", "name": f"chat_{i}", "content": text} for i, text in enumerate(CHAT)]
    out += [{"kind": "translation", "name": f"translate_{lang.lower()}",
             "content": f"Translate into {lang}:\n\n{text}"} for lang, text in TRANSLATE]
    out += [{"kind": "summary", "name": f"summary_{i}", "content": f"Summarise in two sentences:\n\n{text}"}
            for i, text in enumerate(SUMMARIES)]
    return out


def spec_counters(client: httpx.Client, url: str) -> dict[str, float]:
    """The speculation counters of /metrics, summed over labels."""
    names = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    text = client.get(f"{url}/metrics").text
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for name in names:
            if line.startswith(f"tessera:{name}_total{{"):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def settled_counters(client: httpx.Client, url: str, before: dict[str, float]) -> dict[str, float]:
    """Counters after a request, once the stats thread has caught up (it runs after the step)."""
    last, deadline = spec_counters(client, url), time.monotonic() + 2
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = spec_counters(client, url)
        if now == last:
            break
        last = now
    return {k: last[k] - before[k] for k in last}


def run_one(client: httpx.Client, url: str, model: str, content: str, max_tokens: int,
            speculative: bool) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "speculative": speculative}
    before = spec_counters(client, url)
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/chat/completions", json=body)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"{r.status_code}: {r.text[:500]}")
    reply = r.json()
    counters = settled_counters(client, url, before)
    return {"seconds": round(seconds, 4), "tokens": reply["usage"]["completion_tokens"],
            "text": reply["choices"][0]["message"]["content"],
            "drafts": int(counters["spec_decode_num_drafts"]),
            "draft_tokens": int(counters["spec_decode_num_draft_tokens"]),
            "accepted_tokens": int(counters["spec_decode_num_accepted_tokens"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--spec", default=DEFAULT_SPEC, help="--speculative-config of the server")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--limit", type=int, default=0, help="first N prompts only (a quick check)")
    ap.add_argument("--only", default="", help="these prompts only, by name, comma-separated (a re-measurement)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each prompt each way; the fastest counts")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    out_path = args.output or REPO / "benchmarks" / "results" / "speculative" / f"adaptive-{args.model}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log = out_path.with_suffix(".log")
    url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "tessera", "serve", args.model, "--port", str(args.port),
               "--max-model-len", "4096", "--num-threads", str(args.num_threads), "--dtype", args.dtype,
               "--no-enable-prefix-caching",
               "--speculative-config", args.spec]
    prompts = prompt_set()[:args.limit or None]
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {p["name"] for p in prompts}
        if unknown:
            raise SystemExit(f"--only: no prompt named {', '.join(sorted(unknown))}")
        prompts = [p for p in prompts if p["name"] in names]
    rows = []
    with open(log, "w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_for_health(url, proc, str(log))
        with httpx.Client(timeout=900) as client:
            for speculative in (False, True):  # warm-up: first-use costs of both paths
                run_one(client, url, args.model, "Say hello.", 16, speculative)
            for i, p in enumerate(prompts):
                # Its prompt's shapes compiled before either run is timed (no prefix cache: both compute it).
                run_one(client, url, args.model, p["content"], 1, False)
                pair = (False, True) if i % 2 == 0 else (True, False)
                order = [on for r in range(args.repeats) for on in (pair if r % 2 == 0 else pair[::-1])]
                runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
                for on in order:
                    runs[on].append(run_one(client, url, args.model, p["content"], args.max_tokens, on))
                texts = {run.pop("text") for both in runs.values() for run in both}
                off, on = (min(runs[mode], key=lambda run: run["seconds"]) for mode in (False, True))
                row = {"kind": p["kind"], "name": p["name"], "off": off, "on": on,
                       "ratio": round(off["seconds"] / on["seconds"], 4), "identical": len(texts) == 1,
                       "seconds_off": [run["seconds"] for run in runs[False]],
                       "seconds_on": [run["seconds"] for run in runs[True]]}
                rows.append(row)
                print(f"{p['name']:>22} {p['kind']:>11} off {off['seconds']:7.2f}s {off['tokens']:4d} tok  "
                      f"on {on['seconds']:7.2f}s  x{row['ratio']:.3f}  accepted {on['accepted_tokens']}/"
                      f"{on['draft_tokens']} in {on['drafts']} runs  {'same' if row['identical'] else 'DIFFERENT'}",
                      flush=True)
    finally:
        stop_server(proc)
    code = [r for r in rows if r["kind"] == "code_edit"]
    summary = {
        "min_ratio": min(r["ratio"] for r in rows),
        "min_ratio_prompt": min(rows, key=lambda r: r["ratio"])["name"],
        "code_edit_ratio": round(sum(r["off"]["seconds"] for r in code) / sum(r["on"]["seconds"] for r in code), 4)
        if code else None,
        "prompts_below_0.97": [r["name"] for r in rows if r["ratio"] < 0.97],
        "all_identical": all(r["identical"] for r in rows),
        "by_kind": {kind: round(sum(r["off"]["seconds"] for r in rows if r["kind"] == kind)
                                / sum(r["on"]["seconds"] for r in rows if r["kind"] == kind), 4)
                    for kind in dict.fromkeys(r["kind"] for r in rows)},
    }
    result = {"model": args.model, "host_cpu": cpu_model_name(), "num_threads": args.num_threads,
              "repeats": args.repeats,
              "dtype": args.dtype, "speculative_config": json.loads(args.spec), "max_tokens": args.max_tokens,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "summary": summary, "prompts": rows}
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
