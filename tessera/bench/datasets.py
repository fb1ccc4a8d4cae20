"""Seeded synthetic workloads for serving benchmarks.

Prompts are made of words drawn from a fixed English vocabulary so that every
server sees byte-identical requests for a given seed, whatever its tokenizer,
and no data set has to be downloaded. A workload is a list of sessions; a
session is a list of turns sent one after the other (single-turn workloads have
one turn per session; multi-turn chat resends the conversation so far).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

# Common English words: frequent enough to be about one token each in the usual
# BPE vocabularies, so word counts approximate token counts (about 1.1–1.3 tokens a word).
VOCABULARY: tuple[str, ...] = tuple("""
the of and to in is was for on that with as by at from his her it an are were which be this had
not but or have their one all would there been has when who will more no if out so said what up
its about into than them can only other new some could time these two may then do first any my
now such like our over man me even most made after also did many before must through back years
where much your way well down should because each just those people how too little state good
very make world still own see men work long get here between both life being under never day
same another know while last might us great old year off come since against go came right used
take three states himself few house use during without again place around however home small
found thought went say part once general high upon school every does got united left number
course war until always away something fact though water less public put think almost hand
enough far took head yet government system better set told nothing night end why called
didn't eyes find going look asked later knew point next city give group toward young let room
president side social present given several order national second possible rather per face
among form important often things looked early white case john become large big need four
within felt along children saw best church ever least power development light thing seemed
family interest want members mind country area others done turned although open god service
certain kind problem began different door thus help sense means whole matter perhaps itself
york times law human line above name example action company hands local show whether five
history gave today either act feet across taken past quite anyone seen having death week
experience body word half field really car words already themselves information tell together
college shall money period held keep sure free seems real behind cannot miss political air
question making office brought whose special heard major problems ago became federal moment
study available known result street economic boy position reason change south board individual
job areas society west close turn love community true court force full seem wife age future
voice center woman control common policy necessary following front sometimes six girl clear
further land run students provide feel party able mother music education university child
effect level stood military town short morning total outside rate figure class art century
""".split())

# Suffix questions for the shared-prefix workload (RAG-style: one long context, many questions).
QUESTIONS: tuple[str, ...] = (
    "Summarize the text above in one paragraph.",
    "List the five most frequent words in the text above.",
    "What is the main topic of the text above?",
    "Write a short title for the text above.",
    "Rewrite the first sentence of the text above in plain words.",
    "Which words in the text above refer to places?",
    "Explain the text above to a child.",
    "Continue the text above with three more sentences.",
)


@dataclass
class Turn:
    """One request: a plain prompt (completions) or the next user message (chat)."""

    prompt: str
    max_tokens: int
    # Extra request fields (e.g. response_format); a request with extras ends where its model
    # says (no ignore_eos), since a constrained output has its own end.
    extra: dict = field(default_factory=dict)


@dataclass
class Session:
    """Turns sent in order; for chat, each turn carries the whole conversation so far."""

    session_id: int
    turns: list[Turn]
    chat: bool = False
    system: Optional[str] = None
    meta: dict = field(default_factory=dict)
    model: Optional[str] = None  # the model its requests ask for; None: the target's

    @property
    def num_requests(self) -> int:
        return len(self.turns)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCABULARY) for _ in range(n))


def _check_range(name: str, lo: int, hi: int) -> None:
    if lo < 1 or hi < lo:
        raise ValueError(f"{name}: need 1 <= min <= max, got {lo}..{hi}")


def random_workload(num_prompts: int, seed: int, input_words: tuple[int, int] = (50, 400),
                    output_tokens: tuple[int, int] = (16, 256)) -> list[Session]:
    """Independent prompts of uniformly random length and output budget."""
    _check_range("input words", *input_words)
    _check_range("output tokens", *output_tokens)
    rng = random.Random(seed)
    sessions = []
    for i in range(num_prompts):
        n = rng.randint(*input_words)
        sessions.append(Session(i, [Turn(_words(rng, n), rng.randint(*output_tokens))]))
    return sessions


def shared_prefix_workload(num_prompts: int, seed: int, prefix_words: int = 800, num_prefixes: int = 1,
                           suffix_words: tuple[int, int] = (10, 40),
                           output_tokens: tuple[int, int] = (16, 256)) -> list[Session]:
    """Requests that share a long context head (one of `num_prefixes`) and differ in the question.

    This is what prefix caching is for: the head is prefilled once per group.
    """
    _check_range("suffix words", *suffix_words)
    _check_range("output tokens", *output_tokens)
    if prefix_words < 1 or num_prefixes < 1:
        raise ValueError("shared prefix: need prefix words >= 1 and number of prefixes >= 1")
    rng = random.Random(seed)
    heads = [f"Document {g}. " + _words(rng, prefix_words) for g in range(num_prefixes)]
    sessions = []
    for i in range(num_prompts):
        g = i % num_prefixes
        question = rng.choice(QUESTIONS) + " Context words: " + _words(rng, rng.randint(*suffix_words))
        prompt = f"{heads[g]}\n\nQuestion {i}: {question}\nAnswer:"
        sessions.append(Session(i, [Turn(prompt, rng.randint(*output_tokens))], meta={"prefix_group": g}))
    return sessions


def multi_turn_workload(num_conversations: int, seed: int, turns: int = 4,
                        user_words: tuple[int, int] = (20, 100),
                        output_tokens: tuple[int, int] = (16, 256)) -> list[Session]:
    """Chat conversations; the runner appends each reply and resends the conversation."""
    _check_range("user words", *user_words)
    _check_range("output tokens", *output_tokens)
    if turns < 1:
        raise ValueError("multi-turn: need at least one turn per conversation")
    rng = random.Random(seed)
    sessions = []
    for i in range(num_conversations):
        conv = [Turn(f"Turn {t}: " + _words(rng, rng.randint(*user_words)), rng.randint(*output_tokens))
                for t in range(turns)]
        sessions.append(Session(i, conv, chat=True, system="You are a helpful assistant."))
    return sessions


def chat_workload(num_conversations: int, seed: int, turns: int = 3, num_system_prompts: int = 3,
                  system_words: tuple[int, int] = (150, 300), user_words: tuple[int, int] = (10, 60),
                  output_tokens: tuple[int, int] = (16, 128)) -> list[Session]:
    """Multi-turn chat behind a few long shared system prompts (an assistant product's
    instructions): every conversation starts with one of `num_system_prompts` heads, so the
    prefix cache serves the head once per prompt and each turn extends the conversation's own
    earlier turns."""
    _check_range("system words", *system_words)
    _check_range("user words", *user_words)
    _check_range("output tokens", *output_tokens)
    if turns < 1 or num_system_prompts < 1:
        raise ValueError("chat: need at least one turn and one system prompt")
    rng = random.Random(seed)
    systems = [f"You are assistant {k}. Follow these instructions. " + _words(rng, rng.randint(*system_words))
               for k in range(num_system_prompts)]
    sessions = []
    for i in range(num_conversations):
        conv = [Turn(f"Turn {t}: " + _words(rng, rng.randint(*user_words)), rng.randint(*output_tokens))
                for t in range(turns)]
        g = rng.randrange(num_system_prompts)
        sessions.append(Session(i, conv, chat=True, system=systems[g], meta={"system_prompt": g}))
    return sessions


# Pieces of the code-edit workload's snippets: plain Python an instruction-tuned coder can rewrite.
_NAMES = ("total", "count", "items", "values", "result", "buffer", "index", "limit", "score", "weight",
          "offset", "record", "entry", "window", "batch", "size", "key", "name", "price", "amount")
_EDITS = (
    "Rename the variable `{a}` to `{b}` everywhere.",
    "Add type hints to every function.",
    "Add a one-line docstring to every function.",
    "Replace every `for` loop that builds a list with a list comprehension where possible.",
    "Rename the function `{f}` to `{g}` and update its callers.",
)


def _snippet(rng: random.Random, functions: int) -> tuple[str, list[str], list[str]]:
    """A seeded Python module of small functions; returns it with its function and variable names."""
    lines, fnames, used = [], [], []
    for i in range(functions):
        a, b, c = rng.sample(_NAMES, 3)
        used += [a, b, c]
        fname = f"{rng.choice(('compute', 'update', 'load', 'merge', 'filter', 'scale'))}_{a}_{i}"
        fnames.append(fname)
        k = rng.randint(2, 9)
        lines += [f"def {fname}({a}, {b}):",
                  f"    {c} = []",
                  f"    for {'x' if i % 2 else 'item'} in {a}:",
                  f"        if {'x' if i % 2 else 'item'} > {b}:",
                  f"            {c}.append({'x' if i % 2 else 'item'} * {k})",
                  f"    return {c}",
                  ""]
    lines += ["", "def main():"]
    for fname in fnames:
        lines.append(f"    print({fname}([{', '.join(str(rng.randint(0, 20)) for _ in range(4))}], "
                     f"{rng.randint(1, 10)}))")
    return "\n".join(lines) + "\n", fnames, used


def code_edit_workload(num_prompts: int, seed: int, functions: tuple[int, int] = (3, 8),
                       output_tokens: tuple[int, int] = (256, 512)) -> list[Session]:
    """Requests to rewrite a given code snippet with a small edit (chat): the answer copies most of
    its input, the case prompt-lookup (n-gram) and draft-model speculation are measured on."""
    _check_range("functions", *functions)
    _check_range("output tokens", *output_tokens)
    rng = random.Random(seed)
    sessions = []
    for i in range(num_prompts):
        code, fnames, used = _snippet(rng, rng.randint(*functions))
        a = rng.choice(used)
        b = rng.choice([n for n in _NAMES if n not in used] or ["renamed"])
        f = rng.choice(fnames)
        edit = rng.choice(_EDITS).format(a=a, b=b, f=f, g=f + "_v2")
        prompt = f"{edit} Reply with the complete rewritten code only.\n\n```python\n{code}```"
        sessions.append(Session(i, [Turn(prompt, rng.randint(*output_tokens))], chat=True,
                                system="You are a careful coding assistant.", meta={"edit": edit}))
    return sessions


_FIELD_NAMES = ("name", "city", "count", "price", "active", "colour", "size", "tags", "owner", "kind", "level",
                "notes", "status", "items", "score")
_ENUM_WORDS = ("red", "green", "blue", "small", "large", "on", "off")


def random_json_schema(rng: random.Random, depth: int = 0) -> tuple[dict, str]:
    """An object schema (nested objects, arrays, enums, required fields, bounded strings) and a
    plain-words description of its fields, for a prompt asking for it."""
    leaves = [
        ({"type": "string", "maxLength": 24}, "a short string"),
        ({"type": "integer", "minimum": 0, "maximum": 1000}, "an integer"),
        ({"type": "number"}, "a number"),
        ({"type": "boolean"}, "a boolean"),
        ({"enum": rng.sample(_ENUM_WORDS, 3)}, "one of the options"),
        ({"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
         "a list of words"),
    ]
    names = rng.sample(_FIELD_NAMES, rng.randint(2, 4))
    props, parts = {}, []
    for name in names:
        if depth < 1 and rng.random() < 0.25:
            sub, text = random_json_schema(rng, depth + 1)
            props[name] = sub
            parts.append(f"{name} (an object with {text})")
        elif depth < 1 and rng.random() < 0.15:
            sub, text = random_json_schema(rng, depth + 1)
            props[name] = {"type": "array", "items": sub, "minItems": 1, "maxItems": 2}
            parts.append(f"{name} (a list of objects with {text})")
        else:
            schema, text = rng.choice(leaves)
            props[name] = schema
            parts.append(f"{name} ({text})")
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return ({"type": "object", "properties": props, "required": required, "additionalProperties": False},
            ", ".join(parts))


def json_schema_workload(num_prompts: int, seed: int, output_tokens: tuple[int, int] = (16, 256),
                         constrained: bool = True) -> list[Session]:
    """Chat requests asking for JSON with given fields, each with its own schema as
    `response_format` (or, `constrained=False`, the same prompts without it: the baseline)."""
    _check_range("output tokens", *output_tokens)
    rng = random.Random(seed)
    sessions = []
    for i in range(num_prompts):
        schema, text = random_json_schema(rng)
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}} \
            if constrained else {"ignore_eos": False}
        sessions.append(Session(i, [Turn(f"Describe something as a JSON object with these fields: {text}.",
                                         rng.randint(*output_tokens), extra)], chat=True))
    return sessions


DATASETS = ("random", "shared-prefix", "multi-turn", "chat", "code-edit", "json-schema")
CHAT_DATASETS = ("multi-turn", "chat", "code-edit", "json-schema")  # sent to the chat API whatever --endpoint says


def requests_per_session(name: str, turns: int) -> int:
    """Requests one session of dataset `name` sends: a turn each for multi-turn conversations."""
    return max(1, turns) if name in ("multi-turn", "chat") else 1


def build_workload(name: str, num_prompts: int, seed: int, *, input_words: tuple[int, int] = (50, 400),
                   output_tokens: tuple[int, int] = (16, 256), prefix_words: int = 800,
                   num_prefixes: int = 1, turns: int = 4, constrained: bool = True) -> list[Session]:
    """Workload by name; for multi-turn, `num_prompts` counts requests (conversations × turns)."""
    if num_prompts < 1:
        raise ValueError("number of prompts must be at least 1")
    if name == "random":
        return random_workload(num_prompts, seed, input_words, output_tokens)
    if name == "shared-prefix":
        return shared_prefix_workload(num_prompts, seed, prefix_words, num_prefixes,
                                      output_tokens=output_tokens)
    if name == "multi-turn":
        if turns < 1:
            raise ValueError("multi-turn: need at least one turn per conversation")
        conversations = max(1, -(-num_prompts // turns))
        return multi_turn_workload(conversations, seed, turns, output_tokens=output_tokens)
    if name == "chat":
        return chat_workload(max(1, -(-num_prompts // turns)), seed, turns, output_tokens=output_tokens)
    if name == "code-edit":
        return code_edit_workload(num_prompts, seed, output_tokens=output_tokens)
    if name == "json-schema":
        return json_schema_workload(num_prompts, seed, output_tokens=output_tokens, constrained=constrained)
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
