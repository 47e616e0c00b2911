"""GGUF vocabularies become tokenizers that match transformers' GGUF conversion."""

import json
import os

import gguf
import pytest

from checkpoints.gguf_reader import GGUFFile
from checkpoints.tokenizer import Tokenizer

SAMPLES = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "안녕하세요, 세계! 한국어 문장입니다. 中文句子：你好，世界。日本語の文章です。",
    "emoji 😀🙂👍🏽 👨‍👩‍👧‍👦 🇰🇷 ✨ — “quotes” ‘single’ … naïve façade Ünïcödé",
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2  # square\n    else:\n        return -x\n",
    "numbers: 0 7 42 1234567 3.14159 -2.5e-10 1,000,000 0x1F 2026-12-02 $19.99 50%",
    "  leading spaces\n\n\nblank lines\r\nwindows\t\ttabs   trailing   ",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|> <jupyter_code>x = 1</s>",
    "I'm sure you're right, they'll see we've done it; IT'S DONE. Don't.",
    "Русский текст, العربية, עברית, हिन्दी, ไทย, Ελληνικά",
    "",
    " ",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Tell me a joke."},
     {"role": "assistant", "content": "Why did the 🐔 cross the road?"},
     {"role": "user", "content": "왜요?"}],
]


def test_encode_decode_match_transformers(smollm, hf_gguf_tokenizer):
  ours, ref = smollm.tokenizer, hf_gguf_tokenizer
  for text in SAMPLES:
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False), text
    assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
    for skip in (True, False):
      assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
          ids, skip_special_tokens=skip), text
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_vocab_and_special_tokens_match(smollm, hf_gguf_tokenizer):
  ours, ref = smollm.tokenizer, hf_gguf_tokenizer
  assert ours.backend.get_vocab() == ref.get_vocab()
  assert ours.vocab_size == len(ref) == 49152
  added = {i: t.content for i, t in ref.added_tokens_decoder.items() if t.special}
  assert {i for i in range(ours.vocab_size) if ours.is_special(i)} == set(added)
  assert ours.bos_token_id == ref.bos_token_id == 1
  assert ours.id_to_token(2) == "<|im_end|>" and ours.token_to_id("<|im_start|>") == 1
  assert {2, 0} <= ours.eos_token_ids and ref.eos_token_id in ours.eos_token_ids
  assert 1 not in ours.eos_token_ids
  assert not ours.add_bos_token
  assert ours.special_tokens == {"bos_token": ref.bos_token, "eos_token": ref.eos_token,
                                 "unk_token": ref.unk_token, "pad_token": ref.pad_token}


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smollm, hf_gguf_tokenizer, conv,
                                            add_generation_prompt):
  msgs = CONVERSATIONS[conv]
  kw = dict(add_generation_prompt=add_generation_prompt)
  text = smollm.tokenizer.apply_chat_template(msgs, **kw)
  assert text == hf_gguf_tokenizer.apply_chat_template(msgs, tokenize=False, **kw)
  ids = smollm.tokenizer.apply_chat_template(msgs, tokenize=True, **kw)
  assert ids == hf_gguf_tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False,
                                                      **kw)


# -- synthetic GGUF vocabularies for the other pre-tokenizers and sentencepiece --------------

def _small_bpe_vocab(smollm_path, n=3000):
  """The first `n` SmolLM2 tokens and the merges among them (a valid byte-level BPE)."""
  fields = GGUFFile(smollm_path).fields
  tokens = fields["tokenizer.ggml.tokens"][:n]
  types = fields["tokenizer.ggml.token_type"][:n]
  have = set(tokens)
  merges = [m for m in fields["tokenizer.ggml.merges"]
            if all(p in have for p in m.split(" ")) and m.replace(" ", "") in have]
  return tokens, types, merges


def _write_vocab_gguf(path, model, pre, tokens, types, merges=None, scores=None):
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_uint32("llama.vocab_size", len(tokens))
  w.add_tokenizer_model(model)
  if pre:
    w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types(types)
  if merges is not None:
    w.add_token_merges(merges)
  if scores is not None:
    w.add_token_scores(scores)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_add_bos_token(model == "llama")
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _compare_with_transformers(path, texts):
  transformers = pytest.importorskip("transformers")
  ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                   gguf_file=os.path.basename(path))
  ours = Tokenizer.from_gguf_metadata(GGUFFile(str(path)))
  for text in texts:
    ids = ours.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False), (text, ids)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
  return ours, ref


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2", "smollm"])
def test_byte_level_pre_tokenizers(tmp_path, smollm_path, pre):
  tokens, types, merges = _small_bpe_vocab(smollm_path)
  path = tmp_path / f"{pre}.gguf"
  _write_vocab_gguf(path, "gpt2", pre, tokens, types, merges)
  _compare_with_transformers(path, SAMPLES)


def test_sentencepiece_vocab(tmp_path):
  pieces = ["▁", "t", "h", "e", "a", "n", "d", "o", "r", "s", "i", "▁t", "he", "▁the", "an",
            "▁a", "nd", "▁and", "or", "▁o", "in", "▁s", "er", "es", "on", "re", "▁i"]
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
  types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
  scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
  path = tmp_path / "spm.gguf"
  _write_vocab_gguf(path, "llama", None, tokens, types, scores=scores)
  texts = ["the and a sin", " the  andor", "hello wörld 한국 😀", "a\nb\tc", "the</s>"]
  ours, ref = _compare_with_transformers(path, texts)
  assert ours.add_bos_token and ours.encode("the", add_special_tokens=True)[0] == 1
  assert ours.eos_token_ids == {2}
  assert json.loads(ours.backend.to_str())["model"]["byte_fallback"]
  # gguf-py's own reader works as the metadata source too.
  via_gguf_py = Tokenizer.from_gguf_metadata(gguf.GGUFReader(str(path)))
  assert all(via_gguf_py.encode(t) == ours.encode(t) for t in texts)
