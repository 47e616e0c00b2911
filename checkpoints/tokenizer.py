"""Tokenizer: text <-> token ids and chat templates, built from checkpoint files.

`Tokenizer` wraps a Rust `tokenizers.Tokenizer` (fast, releases the GIL) and
adds what a server needs on top of it:
  * special-token bookkeeping: BOS, the set of end-of-generation ids (the
    model's EOS plus llama.cpp-style EOG tokens such as `<|im_end|>`);
  * chat templates rendered with jinja2 exactly as `transformers` renders them
    (sandboxed environment, trim_blocks/lstrip_blocks, the same globals);
  * two constructors: a Hugging Face directory (`tokenizer.json` +
    `tokenizer_config.json`) and a GGUF file's metadata (vocabulary, merges,
    token types, pre-tokenizer name), built the way `transformers` converts
    GGUF vocabularies (see `checkpoints/gguf_vocab.py`).

Streaming detokenization lives with the engine (serving/engine/detokenizer.py).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from checkpoints import gguf_vocab

# Tokens that end a generation when present in the vocabulary as special
# tokens (llama.cpp marks these "EOG" by name).
EOG_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>",
              "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|return|>", "<EOT>",
              "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Tokenizer:
  """Encode/decode, special ids and chat templates for one model.

  Attributes:
    bos_token_id: the BOS id, or None.
    eos_token_ids: ids that end a generation (model EOS + EOG tokens).
    add_bos_token: whether plain text prompts get BOS prepended
      (`encode(text, add_special_tokens=True)` does it).
    chat_template: the jinja2 chat template source, or None.
  """

  def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
               special_tokens: dict[str, str | None] | None = None, add_bos_token: bool = False,
               add_eos_token: bool = False, extra_eos_ids: Iterable[int] = ()):
    self.backend = backend
    self.chat_template = chat_template
    self.special_tokens = {k: v for k, v in (special_tokens or {}).items()
                           if k in _SPECIAL_NAMES and v is not None}
    self._special_ids = frozenset(
        i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
    self.bos_token_id = self._id_or_none(self.special_tokens.get("bos_token"))
    self.eos_token_id = self._id_or_none(self.special_tokens.get("eos_token"))
    self.add_bos_token = bool(add_bos_token) and self.bos_token_id is not None
    self.add_eos_token = bool(add_eos_token) and self.eos_token_id is not None
    # Does the backend's post-processor add BOS/EOS itself (HF tokenizer.json)?
    probe = backend.encode("a", add_special_tokens=True).ids
    self._backend_adds_bos = bool(probe) and probe[0] == self.bos_token_id
    self._backend_adds_eos = len(probe) > 1 and probe[-1] == self.eos_token_id
    self.add_bos_token = self.add_bos_token or self._backend_adds_bos
    eos = {i for i in extra_eos_ids}
    if self.eos_token_id is not None:
      eos.add(self.eos_token_id)
    for name in EOG_TOKENS:
      tid = backend.token_to_id(name)
      if tid is not None and tid in self._special_ids:
        eos.add(tid)
    self.eos_token_ids: frozenset[int] = frozenset(eos)

  # -- constructors ---------------------------------------------------------

  @classmethod
  def from_hf_dir(cls, path: str, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
    """Loads `tokenizer.json` plus `tokenizer_config.json` (and `chat_template.jinja`)."""
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tok_file):
      raise FileNotFoundError(f"no tokenizer.json in {path}")
    backend = tokenizers.Tokenizer.from_file(tok_file)
    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
    special = {name: _token_content(cfg.get(name, special_map.get(name)))
               for name in _SPECIAL_NAMES}
    template = _chat_template_from(cfg.get("chat_template"))
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.exists(jinja_file):
      with open(jinja_file, encoding="utf-8") as f:
        template = f.read()
    return cls(backend, chat_template=template, special_tokens=special,
               add_bos_token=bool(cfg.get("add_bos_token", False)),
               add_eos_token=bool(cfg.get("add_eos_token", False)), extra_eos_ids=extra_eos_ids)

  @classmethod
  def from_gguf_metadata(cls, reader: Any, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
    """Builds the tokenizer a GGUF file describes.

    `reader`: a `checkpoints.gguf_reader.GGUFFile` or a `gguf.GGUFReader`.
    """
    meta = gguf_vocab.read_tokenizer_metadata(reader)
    backend = gguf_vocab.build_backend(meta)
    tokens = meta["tokens"]
    special = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
      tid = meta.get(key)
      special[name] = tokens[tid] if tid is not None and 0 <= tid < len(tokens) else None
    add_bos = meta.get("add_bos_token")
    if add_bos is None:  # llama.cpp's default: sentencepiece vocabularies get BOS
      add_bos = meta.get("model") == "llama"
    return cls(backend, chat_template=meta.get("chat_template"), special_tokens=special,
               add_bos_token=bool(add_bos), add_eos_token=bool(meta.get("add_eos_token", False)),
               extra_eos_ids=extra_eos_ids)

  def save(self, path: str) -> None:
    """Writes `tokenizer.json` and `tokenizer_config.json` (readable by `from_hf_dir`)."""
    os.makedirs(path, exist_ok=True)
    self.backend.save(os.path.join(path, "tokenizer.json"))
    cfg = dict(self.special_tokens, chat_template=self.chat_template,
               add_bos_token=self.add_bos_token and not self._backend_adds_bos,
               add_eos_token=self.add_eos_token)
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump(cfg, f, ensure_ascii=False, indent=1)

  # -- ids and text ---------------------------------------------------------

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self.backend.id_to_token(token_id)

  def is_special(self, token_id: int) -> bool:
    return token_id in self._special_ids

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model wants."""
    ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
    if add_special_tokens:
      if self.add_bos_token and not self._backend_adds_bos:
        ids = [self.bos_token_id, *ids]
      if self.add_eos_token and not self._backend_adds_eos:
        ids = [*ids, self.eos_token_id]
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

  # -- chat -----------------------------------------------------------------

  def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                          add_generation_prompt: bool = True, tokenize: bool = False,
                          chat_template: str | None = None, tools: list[dict] | None = None,
                          documents: list[dict] | None = None, **kwargs) -> str | list[int]:
    """Renders `messages` as `transformers`' `apply_chat_template` does.

    Extra keyword arguments are visible to the template (they override the
    special-token strings `bos_token`, `eos_token`, ...). With `tokenize`, the
    rendered text is encoded without adding special tokens.
    """
    template = chat_template or self.chat_template
    if template is None:
      raise ValueError("this tokenizer has no chat template; pass chat_template=...")
    if not messages:
      raise ValueError("cannot apply a chat template to an empty conversation")
    msgs = [_alias_reasoning({k: v for k, v in dict(m).items() if v is not None})
            for m in messages]
    variables = {**self.special_tokens, **kwargs}
    text = _compile_template(template).render(
        messages=msgs, tools=tools, documents=documents,
        add_generation_prompt=add_generation_prompt, **variables)
    return self.encode(text, add_special_tokens=False) if tokenize else text

  def _id_or_none(self, token: str | None) -> int | None:
    return None if token is None else self.backend.token_to_id(token)


# -- helpers ------------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _token_content(value: Any) -> str | None:
  """A special token from tokenizer_config: a string or an AddedToken dict."""
  if isinstance(value, dict):
    return value.get("content")
  return value


def _chat_template_from(value: Any) -> str | None:
  """tokenizer_config's `chat_template`: a string or a list of named templates."""
  if isinstance(value, list):
    named = {t["name"]: t["template"] for t in value}
    return named.get("default") or next(iter(named.values()), None)
  return value


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
  """Like transformers: a message's reasoning is visible as `reasoning_content` and `thinking`."""
  reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
  if reasoning is None:
    return message
  return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Like transformers: no HTML escaping, and the json.dumps options exposed.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.now().strftime(fmt)


class _TemplateDict:
  """`dict(...)` for templates without exposing the dict type itself."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _GenerationTag(jinja2.ext.Extension):
  """Accepts `{% generation %}...{% endgeneration %}` blocks (rendered as-is)."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  env.globals["dict"] = _TemplateDict()
  return env.from_string(source)
