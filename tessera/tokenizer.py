"""Text <-> token ids, chat templates and streaming detokenization.

The tokenizer is always the model's own: for a Hugging Face folder its
tokenizer files, for a GGUF file the vocabulary in its metadata converted by
transformers' GGUF tokenizer builder. That conversion takes seconds to tens of
seconds (Gemma's 262k vocabulary), so its result -- a `tokenizer.json` plus a
small JSON of special tokens and the chat template -- is cached under
`$TESSERA_HOME/tokenizers/<hash of the GGUF metadata>`; later loads read that.
Encoding and decoding then go straight to the Rust `tokenizers` backend, and
chat templates are rendered by transformers' own jinja renderer, so prompts
match `AutoTokenizer.apply_chat_template` exactly.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

from tokenizers import Tokenizer as BackendTokenizer

from tessera.errors import ModelFormatError
from tessera.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
# Template variables the renderer sets itself; a request's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"conversations", "messages", "tools", "documents", "chat_template",
                                         "add_generation_prompt", "continue_final_message", "return_assistant_tokens_mask"})
# Texts llama.cpp treats as end-of-generation when they are special tokens of the vocabulary.
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
)
# Harmony's (gpt-oss's) message ends: <|return|> ends the answer, <|call|> a tool call, <|end|>
# only a message (see Tokenizer.end_of_generation).
HARMONY_RETURN, HARMONY_CALL, HARMONY_END = "<|return|>", "<|call|>", "<|end|>"


class Tokenizer:
    """A model's tokenizer: encode/decode, chat template, special ids."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: Optional[int],
        eos_token_ids: list[int],
        chat_template: Optional[str],
        special_tokens_map: dict[str, str],
        name: str = "",
    ):
        # A tokenizer.json may carry the truncation and padding its exporter last used
        # (all-MiniLM-L6-v2's pads every text to 128 tokens); those belong to a call, as
        # transformers treats them, never to every encode.
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = self.end_of_generation(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens_map = special_tokens_map
        self.name = name
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    def end_of_generation(self, ids: list[int]) -> list[int]:
        """`ids` as the ids that end generation: without duplicates, and without harmony's
        <|end|> where <|return|> and <|call|> are among them (gpt-oss: <|end|> ends one message
        of an answer that goes on, its analysis before its final one), as llama.cpp decides."""
        ids = list(dict.fromkeys(ids))
        texts = {i: self.backend.id_to_token(i) for i in ids}
        if {HARMONY_RETURN, HARMONY_CALL} <= set(texts.values()):
            ids = [i for i in ids if texts[i] != HARMONY_END]
        return ids

    # -- construction --------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | os.PathLike, cache_dir: Optional[Path] = None, gguf=None) -> "Tokenizer":
        """Tokenizer described by a GGUF file's metadata (converted once, then cached).

        `gguf` may pass an already opened tessera.models.gguf_file.GGUFFile of `path`.
        """
        from tessera.models.gguf_file import read_gguf

        path = Path(path)
        gf = gguf if gguf is not None else read_gguf(path)
        try:
            folder = (cache_dir or default_cache_dir()) / _gguf_metadata_digest(gf)
            gguf_eos = [int(gf.metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                      "tokenizer.ggml.eom_token_id") if k in gf.metadata]
        finally:
            if gguf is None:
                gf.close()
        meta_file = folder / "tessera_tokenizer.json"
        if meta_file.is_file():
            try:
                meta = json.loads(meta_file.read_text())
                if meta.get("format") == CACHE_FORMAT:
                    return cls._from_cached(folder, meta, path.stem)
            except Exception as exc:  # a broken cache entry is rebuilt, never fatal
                logger.warning("tokenizer cache %s unusable (%s); rebuilding it", folder, exc)
        logger.info("converting the tokenizer of %s (first load only; cached in %s)", path.name, folder)
        hf_tok = _convert_gguf_tokenizer(path)
        meta = _metadata_from_hf(hf_tok, extra_eos=gguf_eos)
        try:
            _write_cache(folder, hf_tok, meta)
        except OSError as exc:  # read-only home etc.: work uncached
            logger.warning("could not cache the tokenizer in %s (%s); it is converted again next time", folder, exc)
        return cls._from_meta(hf_tok.backend_tokenizer, meta, path.stem)

    @classmethod
    def from_hf_folder(cls, folder: str | os.PathLike, config_eos_ids: tuple[int, ...] = ()) -> "Tokenizer":
        """Tokenizer of a Hugging Face model folder (tokenizer.json, tokenizer_config.json)."""
        folder = Path(folder)
        # The module itself: transformers' lazy top-level names fail (ImportError) when threads
        # reach them at once, as the replicas' front ends do when they start together.
        from transformers.models.auto.tokenization_auto import AutoTokenizer

        try:
            hf_tok = AutoTokenizer.from_pretrained(str(folder))
        except Exception as exc:  # transformers raises many types for a missing/bad tokenizer
            raise ModelFormatError(
                f"cannot load the tokenizer in {folder} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
                "the folder needs tokenizer.json / tokenizer_config.json"
            ) from None
        extra = list(config_eos_ids) + _generation_config_eos(folder)
        meta = _metadata_from_hf(hf_tok, extra_eos=extra)
        return cls._from_meta(hf_tok.backend_tokenizer, meta, folder.name)

    @classmethod
    def _from_cached(cls, folder: Path, meta: dict[str, Any], name: str) -> "Tokenizer":
        return cls._from_meta(BackendTokenizer.from_file(str(folder / "tokenizer.json")), meta, name)

    @classmethod
    def _from_meta(cls, backend: BackendTokenizer, meta: dict[str, Any], name: str) -> "Tokenizer":
        return cls(
            backend,
            bos_token_id=meta["bos_token_id"],
            eos_token_ids=meta["eos_token_ids"],
            chat_template=meta["chat_template"],
            special_tokens_map=meta["special_tokens_map"],
            name=name,
        )

    # -- API -----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_bounded(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int]:
        """`encode`, but a text that cannot fit in `max_tokens` (more bytes than that many of the
        vocabulary's longest tokens) is refused before tokenizing: a 10 MB prompt would otherwise
        hold a thread for seconds only to be refused for its length."""
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > max_tokens * self.max_token_bytes + 64:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_tokens} tokens; the prompt ({size} bytes) "
                "is longer than that.")
        return self.encode(text, add_special_tokens=add_special_tokens)

    def encode_truncated(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int]:
        """`encode` cut to at most `max_tokens` ids the way Hugging Face truncation (and so
        sentence-transformers) cuts a single text: the text's own tokens first, then the
        special tokens around them ([CLS] ... [SEP] stay)."""
        enc = self.backend.encode(text, add_special_tokens=False)
        specials = self.backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        if max_tokens <= specials:
            raise InvalidRequestError(f"an input of at most {max_tokens} tokens has no room for text")
        if len(enc.ids) > max_tokens - specials:
            enc.truncate(max_tokens - specials)
        return self.backend.post_process(enc).ids if add_special_tokens else enc.ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """Bytes of the vocabulary's longest token (an upper bound on the text one token covers)."""
        return max((len(t.encode("utf-8")) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Printable text of one token, special tokens included (for logprobs)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """The vocabulary's own strings for `ids` (byte-level pieces such as "Ġthe", as
        transformers names them), which `/tokenize` returns as `token_strs`."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None, chat_template: Optional[str] = None,
                            template_kwargs: Optional[dict] = None) -> str:
        """Render a conversation with the model's own template (transformers' jinja renderer), or
        with `chat_template` in its place; `tools` are OpenAI function definitions, for templates
        that render them; `template_kwargs` are extra template variables (`enable_thinking`).

        Encode the result with add_special_tokens=False: templates write BOS themselves.
        """
        chat_template = chat_template or self.chat_template
        if not chat_template:
            raise InvalidRequestError(
                f"model {self.name or ''} has no chat template; use the completions API with a plain prompt"
            )
        if not messages:
            raise InvalidRequestError("messages must not be empty")
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
        extra = dict(template_kwargs or {})
        taken = sorted(set(extra) & RESERVED_TEMPLATE_VARIABLES)
        if taken:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(taken)}")
        try:
            rendered, _ = render_jinja_template(
                conversations=[conversation],
                tools=tools,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens_map, **extra},
            )
        except TemplateError as exc:  # e.g. "Conversation roles must alternate user/assistant/..."
            raise InvalidRequestError(f"chat template rejected the messages: {exc}") from None
        return rendered[0]


    def warm_up(self) -> None:
        """Render a one-message conversation now: importing the renderer and compiling the template
        cost ~0.7 s here, which the first chat request to a server would otherwise pay in its TTFT."""
        if not self.chat_template:
            return
        try:
            self.apply_chat_template([{"role": "user", "content": "warm-up"}])
        except InvalidRequestError:  # a template that wants a system message first, etc.: nothing to warm
            pass


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Decodes a short window of already-emitted tokens plus the new ones and emits
    the difference (as vLLM's detokenize_incrementally does), so sentencepiece's
    leading-space handling and multi-token UTF-8 characters come out right. A
    delta is held back while the window's text ends in U+FFFD (an incomplete
    UTF-8 sequence) and released once the character completes.
    """

    INITIAL_WINDOW = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - self.INITIAL_WINDOW, 0)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text it completes (possibly "")."""
        self.ids.append(token_id)
        if self.skip_special_tokens and token_id in self.tokenizer.special_token_ids:
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        new_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Text still held back (an unfinished UTF-8 sequence at the end of generation)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        new_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""


# ---------------------------------------------------------------------------
# helpers


def serialized_bytes(model_path: str | os.PathLike) -> int:
    """Size of the model's tokenizer as tokenizer.json, 0 if there is none to read. A GGUF
    model's is its converted form in the tokenizer cache, converted now if no server has done it
    yet. The sizing calculator scales a tokenizer's resident memory by it (vocabulary and merges:
    gemma3's 262k-entry one holds ~300 MiB in each process, smollm2's ~70 MiB)."""
    path = Path(model_path)
    if path.is_dir():
        file = path / "tokenizer.json"
    else:
        from tessera.models.gguf_file import read_gguf

        gf = read_gguf(path)
        try:
            file = default_cache_dir() / _gguf_metadata_digest(gf) / "tokenizer.json"
        finally:
            gf.close()
        if not file.is_file():
            try:
                Tokenizer.from_gguf(path)  # converts and caches it, as a server's first start does
            except ModelFormatError:  # no usable tokenizer: the rest of an estimate still stands
                return 0
    try:
        return file.stat().st_size
    except OSError:  # an uncached conversion (read-only home) or a folder without tokenizer.json
        return 0


def default_cache_dir() -> Path:
    try:
        from tessera.models.registry import tessera_home
    except ImportError:  # registry not available: same default location
        env = os.environ.get("TESSERA_HOME")
        home = Path(env).expanduser() if env else Path.home() / ".cache" / "tessera"
    else:
        home = tessera_home()
    return home / "tokenizers"


def _gguf_metadata_digest(gf) -> str:
    """Hash of the GGUF bytes before the tensor data: the tokenizer depends on nothing else."""
    from importlib.metadata import version

    digest = hashlib.sha256(gf.header_bytes()).hexdigest()[:24]

    return f"{digest}-tf{version('transformers')}"


def _convert_gguf_tokenizer(path: Path):
    from transformers.models.auto.tokenization_auto import AutoTokenizer  # the module: see from_hf_folder

    try:
        try:
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except (ValueError, TypeError) as exc:
            if isinstance(exc, ValueError) and "is not supported yet" not in str(exc):
                raise
            # transformers reads the model's config to pick a tokenizer class and knows fewer GGUF
            # architectures than Tessera runs (olmo2, granite, smollm3), or fails reading their
            # keys (gpt-oss's YaRN ones: a TypeError); the vocabulary itself is one of the kinds it
            # converts, whatever the architecture.
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # unsupported tokenizer type, corrupt vocabulary, ...
        raise ModelFormatError(
            f"cannot build the tokenizer of {path.name} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "the file's tokenizer metadata is missing or of an unsupported kind"
        ) from None


def _generation_config_eos(folder: Path) -> list[int]:
    try:
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]


def _metadata_from_hf(hf_tok, extra_eos: list[int]) -> dict[str, Any]:
    backend = hf_tok.backend_tokenizer
    special = {i: t.content for i, t in backend.get_added_tokens_decoder().items() if t.special}
    eos = [hf_tok.eos_token_id] if hf_tok.eos_token_id is not None else []
    eos += extra_eos
    eos += [i for i, text in sorted(special.items()) if text in END_OF_GENERATION_TEXTS]
    template = hf_tok.chat_template if isinstance(hf_tok.chat_template, str) else None
    if isinstance(hf_tok.chat_template, dict):  # named templates: the default one is used
        template = hf_tok.chat_template.get("default")
    return {
        "format": CACHE_FORMAT,
        "bos_token_id": hf_tok.bos_token_id,
        "eos_token_ids": list(dict.fromkeys(int(e) for e in eos)),
        "chat_template": template,
        "special_tokens_map": dict(hf_tok.special_tokens_map),
    }


def _write_cache(folder: Path, hf_tok, meta: dict[str, Any]) -> None:
    """Write atomically (temp dir + rename) so a crash never leaves a half-written entry."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        hf_tok.backend_tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tessera_tokenizer.json").write_text(json.dumps(meta, indent=1))
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
