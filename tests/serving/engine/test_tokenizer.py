"""The tokenizer (checkpoints/) and incremental detokenizer (serving/engine/), chat templates."""

import os
import random

import pytest

from checkpoints.tokenizer import Tokenizer
from serving.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world! 안녕하세요 😀👍🏽 你好，世界。 naïve café — “quoted” …",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # 🐍\n",
    "👨‍👩‍👧‍👦🇰🇷✨🙂 emoji only, then Korean: 한국어 문장입니다.",
    "<|im_start|>assistant\nSure!<|im_end|>\n<|endoftext|>",
    "العربية עברית हिन्दी ไทย Ελληνικά Русский 日本語",
]


@pytest.fixture(scope="module")
def tok(default_tokenizer):
  return default_tokenizer


def _stream(tok, ids, chunks, skip=True):
  detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
  out, i = [], 0
  for n in chunks:
    out.append(detok.push(ids[i:i + n]))
    i += n
  out.append(detok.push(ids[i:]))
  out.append(detok.flush())
  return out


@pytest.mark.parametrize("skip", [True, False])
def test_token_by_token_equals_decode(tok, skip):
  for text in TEXTS:
    ids = tok.encode(text)
    deltas = _stream(tok, ids, [1] * len(ids), skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)


def test_split_multibyte_characters_are_held_back(tok):
  ids = tok.encode("😀")
  assert len(ids) > 1  # a 4-byte emoji spans several byte-level tokens
  detok = IncrementalDetokenizer(tok)
  deltas = [detok.push([i]) for i in ids]
  assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"
  # An unfinished character comes out (as U+FFFD) only at flush.
  detok = IncrementalDetokenizer(tok)
  assert detok.push(ids[:-1]) == ""
  assert detok.flush() == tok.decode(ids[:-1])


def test_random_chunks_and_random_ids(tok):
  rng = random.Random(0)
  ids_all = [i for t in TEXTS for i in tok.encode(t)]
  for trial in range(60):
    if trial % 2:
      ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 80))]
    else:
      start = rng.randrange(len(ids_all))
      ids = ids_all[start:start + rng.randrange(1, 120)]
    chunks = [rng.randrange(0, 4) for _ in range(len(ids))]
    for skip in (True, False):
      assert "".join(_stream(tok, ids, chunks, skip)) == tok.decode(ids, skip), (trial, ids)


def test_window_stays_small(tok):
  """O(1) per token: each decode sees a few tokens, not the whole sequence."""
  ids = tok.encode(" ".join(TEXTS) * 40)
  seen = []
  real_decode = tok.decode

  def spy(window, skip_special_tokens=True):
    seen.append(len(window))
    return real_decode(window, skip_special_tokens)

  detok = IncrementalDetokenizer(tok)
  detok._tok = type("Spy", (), {"decode": staticmethod(spy)})()
  text = "".join(detok.push([i]) for i in ids) + detok.flush()
  assert text == tok.decode(ids) and len(ids) > 1000
  assert max(seen) <= 8


def test_prompt_context(tok):
  prompt, gen = tok.encode("User said: hello"), tok.encode(" world 😀 안녕")
  detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
  text = "".join(detok.push([i]) for i in gen) + detok.flush()
  assert text == tok.decode(gen) and detok.token_ids == gen


def test_prompt_context_keeps_sentencepiece_leading_space():
  from checkpoints.gguf_vocab import build_backend
  pieces = ["▁", "h", "i", "▁hi", "t", "e", "▁the"]
  meta = {"model": "llama", "tokens": ["<unk>", "<s>", "</s>", *pieces],
          "token_type": [2, 3, 3] + [1] * len(pieces),
          "scores": [0.0] * 3 + [-float(i) for i in range(len(pieces))],
          "bos_token_id": 1, "eos_token_id": 2}
  sp = Tokenizer(build_backend(meta), special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
  prompt, gen = sp.encode("hi"), sp.encode(" the hi")
  assert sp.decode(gen) == "the hi"  # decoded alone, the first space is stripped
  detok = IncrementalDetokenizer(sp, prompt_ids=prompt)
  assert "".join(detok.push([i]) for i in gen) + detok.flush() == " the hi"
  plain = IncrementalDetokenizer(sp)
  assert "".join(plain.push([i]) for i in gen) + plain.flush() == "the hi"


def test_special_ids(tok):
  assert tok.bos_token_id == 1 and tok.eos_token_id == 2
  assert tok.eos_token_ids == {0, 2}
  assert tok.is_special(2) and not tok.is_special(tok.encode("hello")[0])
  assert tok.token_to_id("<|im_end|>") == 2 and tok.id_to_token(2) == "<|im_end|>"
  assert tok.vocab_size == 49152 and not tok.add_bos_token


TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "  <{{ m['role'] }}>\n    {{ m['content'] | trim }}\n"
    "{% if m.get('tool_calls') %}{{ m['tool_calls'] | tojson }}{% endif %}"
    "{% endfor %}{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{{ ns.n }}{{ eos_token }}"
    "{% if extra %}[{{ extra }}]{% endif %}"
)


def test_hf_dir_round_trip_and_templates_match_transformers(tok, tmp_path):
  transformers = pytest.importorskip("transformers")
  tok.chat_template, saved = TEMPLATE, tok.chat_template
  try:
    tok.save(str(tmp_path))
  finally:
    tok.chat_template = saved
  ours = Tokenizer.from_hf_dir(str(tmp_path))
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  msgs = [{"role": "system", "content": "  Be <b>brief</b>  "},
          {"role": "user", "content": "Hi \"there\" 😀", "tool_calls": [{"name": "f", "x": "é"}]},
          {"role": "assistant", "content": None}]
  tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": "<&>"}}}]
  for agp in (True, False):
    for kw in ({}, {"tools": tools}, {"extra": "ctx"}):
      want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp, **kw)
      assert ours.apply_chat_template(msgs, add_generation_prompt=agp, **kw) == want
  with pytest.raises(Exception, match="bad role"):
    ours.apply_chat_template([{"role": "robot", "content": "x"}])
  for text in TEXTS:
    assert ours.encode(text) == tok.encode(text) == ref.encode(text, add_special_tokens=False)
  assert ours.eos_token_ids == tok.eos_token_ids and os.path.exists(tmp_path / "tokenizer.json")


def test_no_template_is_an_error(tok):
  bare = Tokenizer(tok.backend)
  with pytest.raises(ValueError, match="chat template"):
    bare.apply_chat_template([{"role": "user", "content": "x"}])
