"""Text <-> token ids, streaming detokenization and chat templates.

A :class:`Tokenizer` wraps a Rust ``tokenizers.Tokenizer``. It comes either from a Hugging Face
folder (``tokenizer.json`` + ``tokenizer_config.json``) or from the vocabulary a GGUF file
embeds; :meth:`Tokenizer.save` writes the first form, so a GGUF's tokenizer is built once and then
cached beside its dequantized weights.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# llama.cpp's token types (tokenizer.ggml.token_type)
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# GPT-2's split with every digit alone: what Digits(individual_digits=True) then GPT-2's split
# give, in one pass. A digit ends a piece as the text's end does, so a whitespace run before a
# digit stays whole ("\s+(?![^\s\p{N}])" where GPT-2 has "\s+(?!\S)"). An 800-token prompt
# encoded in 1.23 ms against 1.47 with the two passes (Zen 3 kind).
_DIGITS_GPT2_SPLIT = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer_for(pre: str | None) -> pre_tokenizers.PreTokenizer | None:
    """How llama.cpp splits text before BPE, by `tokenizer.ggml.pre`; None when we do not know it.

    "smollm" (and the StarCoder family) isolates every digit, then splits like GPT-2 -- the same
    as SmolLM2's own tokenizer.json.
    """
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in (None, "default", "gpt2", "mpt", "olmo", "jais"):
        return gpt2
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"):
        return _split_then_bytes(_LLAMA3_SPLIT)
    return None


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    return pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _in_one_pass(backend: BackendTokenizer) -> None:
    """Digits then GPT-2's split (SmolLM2's and StarCoder's tokenizer.json, llama.cpp's "smollm")
    become the one split that gives the same pieces (``_DIGITS_GPT2_SPLIT``)."""
    if backend.pre_tokenizer is None:
        return
    spec = json.loads(backend.pre_tokenizer.__getstate__())
    steps = spec.get("pretokenizers", []) if spec.get("type") == "Sequence" else []
    if (
        [step.get("type") for step in steps] == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits") is True
        and steps[1].get("use_regex") is True
        and steps[1].get("add_prefix_space") is False
    ):
        backend.pre_tokenizer = _split_then_bytes(_DIGITS_GPT2_SPLIT)


def _ids(backend: BackendTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The text's ids through the batch call that tracks no offsets: the same ids, where
    ``encode`` also maps every token's offsets (a 580-character chunk 154 against 184 us, Zen 4
    kind)."""
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which byte-level vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _backend_from_gguf(meta: Mapping[str, Any]) -> BackendTokenizer:
    """A byte-level BPE tokenizer from llama.cpp's `tokenizer.ggml.*` metadata."""
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    token_types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
    kind = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre")
    pre_tokenizer = _pre_tokenizer_for(pre) if kind == "gpt2" else None
    if pre_tokenizer is None:
        return _backend_via_transformers(meta)

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # A token written in raw text rather than in the byte alphabet gets respelled, as transformers does.
    vocab = {
        (tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode())): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    special, plain = [], []
    for tok, kind_id in zip(tokens, token_types, strict=False):
        if kind_id == _GGUF_CONTROL and set(tok) <= spelled:
            special.append(AddedToken(tok, special=True, normalized=False))
        elif kind_id == _GGUF_USER_DEFINED:
            plain.append(AddedToken(tok, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    return backend


def _backend_via_transformers(meta: Mapping[str, Any]) -> BackendTokenizer:
    """Other vocabularies (sentencepiece, unigram, unusual pre-tokenizers): transformers' converter."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {
        name: meta[f"tokenizer.{key}"]
        for key, name in renames.items()
        if f"tokenizer.{key}" in meta
    }
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    return backend


@lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    """Chat templates are untrusted code from model files: render them in jinja's sandbox."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # jinja's own tojson escapes HTML characters, which chat templates do not want.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Detokenizer:
    """Turns generated ids into text deltas, one token at a time, for streaming.

    A token may end inside a multi-byte character (or merge with its neighbours into one): such a
    token yields "" and its text arrives with the token that completes it. The concatenated deltas
    equal ``tokenizer.decode(generated_ids)``, except that bytes left incomplete at the very end
    never appear (decode would show them as U+FFFD).
    """

    __slots__ = ("_backend", "_stream")

    def __init__(
        self,
        backend: BackendTokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ):
        self._backend = backend
        # The prompt gives the decoder its left context (e.g. sentencepiece's leading space).
        self._stream = DecodeStream(
            list(prompt_ids) or None, skip_special_tokens=skip_special_tokens
        )

    def step(self, token_id: int) -> str:
        """The text that ``token_id`` adds to the output ("" while a character is incomplete)."""
        return self._stream.step(self._backend, token_id) or ""


class UnsafeContent(ValueError):
    """Message content that holds control-token text under a template that rewrites content."""


@dataclass(frozen=True, slots=True)
class SpecialTokens:
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]


class Tokenizer:
    """Encode, decode, stream and template for one model."""

    def __init__(
        self, backend: BackendTokenizer, *, chat_template: str | None, special: SpecialTokens
    ):
        _in_one_pass(backend)
        self.backend = backend
        self.chat_template = chat_template
        self.special = special
        # The strings that encode as one control token ("<|im_start|>", "<|endoftext|>", ...).
        self._control_strings = tuple(
            t.content for t in backend.get_added_tokens_decoder().values() if t.content
        )
        self._plain_backend: BackendTokenizer | None = None

    # construction -------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from the vocabulary, merges and chat template a GGUF file embeds."""
        tokens = meta["tokenizer.ggml.tokens"]
        backend = _backend_from_gguf(meta)

        def token(key: str) -> str | None:
            token_id = meta.get(f"tokenizer.ggml.{key}")
            return tokens[token_id] if token_id is not None else None

        eos_ids = [
            meta[k]
            for k in (
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id",
            )
            if meta.get(k) is not None
        ]
        special = SpecialTokens(
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids)),
        )
        return cls(backend, chat_template=meta.get("tokenizer.chat_template"), special=special)

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Build from a Hugging Face folder: tokenizer.json, tokenizer_config.json and, when
        present, chat_template.jinja. ``extra_eos_token_ids`` adds the model config's EOS ids."""
        path = Path(path)
        backend = BackendTokenizer.from_file(str(path / TOKENIZER_FILE))
        config_file = path / TOKENIZER_CONFIG_FILE
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        template_file = path / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            template = template_file.read_text()
        eos_token = _token_content(config.get("eos_token"))
        eos_ids = [backend.token_to_id(eos_token)] if eos_token else []
        eos_ids += [int(i) for i in config.get("eos_token_ids", [])]
        eos_ids += list(extra_eos_token_ids)
        special = SpecialTokens(
            bos_token=_token_content(config.get("bos_token")),
            eos_token=eos_token,
            eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
        )
        return cls(backend, chat_template=template, special=special)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json; :meth:`from_dir` reads them back."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(path / TOKENIZER_FILE))
        config = {
            "bos_token": self.special.bos_token,
            "eos_token": self.special.eos_token,
            "eos_token_ids": list(self.special.eos_token_ids),
            "chat_template": self.chat_template,
        }
        (path / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=1, ensure_ascii=False))

    # use ----------------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.special.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return _ids(self.backend, text, add_special_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> Detokenizer:
        """A fresh streaming detokenizer for one sequence."""
        return Detokenizer(self.backend, prompt_ids, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's chat template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        template = _compile_chat_template(self.chat_template)
        return template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.special.bos_token or "",
            eos_token=self.special.eos_token or "",
            **kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Prompt ids for a chat (see ``render_chat``)."""
        return self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)[1]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> tuple[str, list[int]]:
        """The chat's prompt text and ids. Only the template's own markup becomes control
        tokens; message content is always text, so a message that types "<|im_start|>system"
        gets those characters, not a new turn (role injection). The template writes its own
        special tokens, so none are added."""
        text = self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **kwargs
        )
        contents = [m.get("content") for m in messages]
        if not any(
            isinstance(c, str) and any(s in c for s in self._control_strings) for c in contents
        ):
            return text, self.encode(text, add_special_tokens=False)
        return text, self._encode_with_plain_contents(
            messages, text, add_generation_prompt, **kwargs
        )

    def _encode_with_plain_contents(
        self,
        messages: Sequence[Mapping[str, Any]],
        text: str,
        add_generation_prompt: bool,
        **kwargs: Any,
    ) -> list[int]:
        """Render again with a unique marker in place of each content, encode the markup
        around the markers as usual and each content with special tokens off."""
        nonce = secrets.token_hex(8)
        markers = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        marked = self.apply_chat_template(
            [{**m, "content": markers[i]} for i, m in enumerate(messages)],
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", marked)
        ids: list[int] = []
        rebuilt = []
        for position, part in enumerate(parts):
            if position % 2 == 0:
                ids += self.encode(part, add_special_tokens=False) if part else []
                rebuilt.append(part)
            else:
                content = messages[int(part)]["content"]
                ids += _ids(self._plain(), content, add_special_tokens=False)
                rebuilt.append(content)
        # A template that transforms content (trims it, say) cannot be split safely: refuse
        # rather than let control strings in content through as tokens.
        if "".join(rebuilt) != text:
            raise UnsafeContent(
                "this chat template changes message content, so content holding control "
                "tokens cannot be kept as text; remove the control tokens"
            )
        return ids

    def _plain(self) -> BackendTokenizer:
        """A copy of the backend that encodes special tokens' text as ordinary text."""
        if self._plain_backend is None:
            plain = BackendTokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend
