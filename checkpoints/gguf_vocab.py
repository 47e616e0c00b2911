"""GGUF vocabulary metadata -> a `tokenizers.Tokenizer`.

A GGUF file has no `tokenizer.json`: it stores the vocabulary, merges, token
types and a pre-tokenizer name under llama.cpp's keys. This module rebuilds
the tokenizer they describe the way `transformers`' GGUF converter does
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`), so our ids match
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`:

  * `tokenizer.ggml.model == "gpt2"`: byte-level BPE. The split regex comes
    from `tokenizer.ggml.pre`; names transformers does not list (`smollm`,
    `gpt-2`, ...) get the plain GPT-2 byte-level regex, except `smollm` and
    the StarCoder family, whose merges were learned on single digits, so a
    `Digits(individual_digits=True)` split runs first (as llama.cpp and the
    original tokenizer.json do; the vocabulary has no multi-digit merges, so
    the ids are the same as transformers').
  * `tokenizer.ggml.model == "llama"`: sentencepiece-style BPE with byte
    fallback and a `▁` metaspace, merges from the file or rebuilt from scores.

Token type 3 (CONTROL) becomes a special added token, 4 (USER_DEFINED) a
plain added token.
"""

from __future__ import annotations

import functools
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from checkpoints.gguf_reader import metadata_value

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> split regex (as in transformers' GGUF_PRE_TOKENIZER_SPLITS).
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx",
                     "pixtral", "lfm2"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}
# Pre-tokenizers that split digits one by one before the GPT-2 regex.
DIGIT_SPLIT_PRES = frozenset({"smollm", "starcoder", "refact", "codeshell"})

_KEYS = {
    "tokenizer.ggml.model": "model",
    "tokenizer.ggml.pre": "pre",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unknown_token_id",
    "tokenizer.ggml.padding_token_id": "padding_token_id",
    "tokenizer.ggml.add_bos_token": "add_bos_token",
    "tokenizer.ggml.add_eos_token": "add_eos_token",
    "tokenizer.ggml.add_space_prefix": "add_space_prefix",
    "tokenizer.chat_template": "chat_template",
}


def read_tokenizer_metadata(reader: Any) -> dict[str, Any]:
  """Tokenizer fields of a GGUF reader (ours or gguf's), under short names (`_KEYS`)."""
  meta = {}
  for key, name in _KEYS.items():
    value = metadata_value(reader, key)
    if value is not None:
      meta[name] = value
  if "tokens" not in meta:
    raise ValueError("GGUF file has no tokenizer.ggml.tokens: cannot build its tokenizer")
  return meta


def build_backend(meta: dict[str, Any]) -> Tokenizer:
  """A `tokenizers.Tokenizer` for the vocabulary in `meta` (see module docstring)."""
  kind = meta.get("model")
  if kind == "gpt2":
    tok = _byte_level_bpe(meta)
  elif kind == "llama":
    tok = _sentencepiece_bpe(meta)
  else:
    raise ValueError(f"unsupported GGUF tokenizer model tokenizer.ggml.model={kind!r} "
                     "(supported: 'gpt2', 'llama')")
  _add_special_tokens(tok, meta, byte_level=kind == "gpt2")
  return tok


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable character table."""
  bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1)))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs), strict=True))


def _byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
  spelling = bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab = {}
  for index, token in enumerate(meta["tokens"]):
    if not set(token) <= alphabet:
      token = "".join(spelling[b] for b in token.encode("utf-8"))
    vocab.setdefault(token, index)
  merges = [tuple(m.split(" ", 1)) for m in meta.get("merges", [])]
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                             continuing_subword_prefix="", end_of_word_suffix="",
                             fuse_unk=False))
  pre = meta.get("pre")
  split = PRE_TOKENIZER_SPLITS.get(pre)
  if split is not None:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  elif pre in DIGIT_SPLIT_PRES:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  else:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  return tok


def _sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
  tokens = meta["tokens"]
  vocab = {}
  for index, token in enumerate(tokens):
    vocab.setdefault(token, index)
  if "merges" in meta:
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
  else:
    merges = _merges_from_scores(vocab, dict(zip(tokens, meta.get("scores") or [], strict=False)))
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                             dropout=None))
  prefix = bool(meta.get("add_space_prefix", True))
  tok.pre_tokenizer = pre_tokenizers.Metaspace(
      replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
  steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  if prefix:
    steps.append(decoders.Strip(content=" ", left=1))
  tok.decoder = decoders.Sequence(steps)
  return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
  """Recovers BPE merges from a scored vocabulary (transformers' `generate_merges`)."""
  merges = []
  for merge, score in scores.items():
    local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
             if merge[:i] in vocab and merge[i:] in vocab]
    local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
    merges.extend(local)
  merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
  return [(a, b) for a, b, _ in merges]


def _add_special_tokens(tok: Tokenizer, meta: dict[str, Any], byte_level: bool) -> None:
  types = meta.get("token_type") or []
  tokens = meta["tokens"]
  spelled = set(bytes_to_unicode().values()) if byte_level else None
  control = [
      AddedToken(t, normalized=False, special=True)
      for t, kind in zip(tokens, types, strict=False)
      # A control token outside the byte alphabet is a llama.cpp mislabel.
      if kind == TOKEN_TYPE_CONTROL and (spelled is None or set(t) <= spelled)]
  if control:
    tok.add_special_tokens(control)
  vocab = tok.get_vocab()
  user = [AddedToken(t, normalized=False, special=False)
          for t, kind in zip(tokens, types, strict=False)
          if kind == TOKEN_TYPE_USER_DEFINED and t in vocab]
  if user:
    tok.add_tokens(user)
