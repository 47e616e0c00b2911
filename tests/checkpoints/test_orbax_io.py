"""orbax round trip: params, config and tokenizer come back identical."""

import jax
import ml_dtypes
import numpy as np
import pytest
from ckpt_testutil import assert_params_equal, tiny_model

from checkpoints import LoadedModel, load_checkpoint, load_orbax, save_orbax
from checkpoints.orbax_io import MARKER_FILE

MESSAGES = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "안녕 😀"}]


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory, smollm):
  """A tiny qwen3_moe HF dir carrying the real SmolLM2 tokenizer."""
  path = tmp_path_factory.mktemp("hf")
  tiny_model("qwen3_moe", vocab_size=smollm.config.vocab_size).save_pretrained(path)
  smollm.tokenizer.save(str(path))
  return load_checkpoint(str(path))


def _same_tokenizer(a, b):
  for text in ("Hello, world!", "def f():\n\treturn 1", "한국어 😀 中文 <|im_end|>"):
    assert a.encode(text) == b.encode(text)
    assert a.encode(text, add_special_tokens=True) == b.encode(text, add_special_tokens=True)
    ids = a.encode(text)
    assert a.decode(ids) == b.decode(ids) and a.decode(ids, False) == b.decode(ids, False)
  for agp in (True, False):
    assert (a.apply_chat_template(MESSAGES, add_generation_prompt=agp)
            == b.apply_chat_template(MESSAGES, add_generation_prompt=agp))
  assert (a.bos_token_id, a.eos_token_ids, a.add_bos_token, a.vocab_size, a.special_tokens) == (
      b.bos_token_id, b.eos_token_ids, b.add_bos_token, b.vocab_size, b.special_tokens)


def test_round_trip(tmp_path, tiny_with_tokenizer):
  src = tiny_with_tokenizer
  out = save_orbax(src, str(tmp_path / "ckpt"))
  assert (tmp_path / "ckpt" / MARKER_FILE).exists()
  back = load_checkpoint(out)
  assert back.config == src.config
  assert_params_equal(back.params, src.params)
  assert all(isinstance(v, np.ndarray) for v in back.params["layers"].values())
  _same_tokenizer(back.tokenizer, src.tokenizer)


def test_round_trip_bfloat16_and_overwrite(tmp_path, tiny_with_tokenizer):
  src = tiny_with_tokenizer
  bf16 = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), src.params)
  path = str(tmp_path / "ckpt")
  save_orbax(LoadedModel(src.config, src.params, src.tokenizer, "x"), path)
  save_orbax(LoadedModel(src.config, bf16, src.tokenizer, "x"), path)  # replaces
  back = load_orbax(path)
  assert back.params["layers"]["we_up"].dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(back.params["layers"]["we_up"], bf16["layers"]["we_up"])
  as_f32 = load_checkpoint(path, dtype=np.float32)
  assert as_f32.params["embed"].dtype == np.float32


def test_restore_onto_shardings(tmp_path, tiny_with_tokenizer):
  src = tiny_with_tokenizer
  path = save_orbax(src, str(tmp_path / "ckpt"))
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = jax.tree.map(lambda _: sharding, src.params)
  back = load_orbax(path, shardings=shardings)
  wq = back.params["layers"]["wq"]
  assert isinstance(wq, jax.Array) and wq.sharding == sharding
  np.testing.assert_array_equal(np.asarray(wq), src.params["layers"]["wq"])
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, ml_dtypes.bfloat16, sharding=sharding), src.params)
  back = load_orbax(path, abstract_params=abstract)
  assert back.params["embed"].dtype == ml_dtypes.bfloat16


def test_real_model_orbax_loads_faster_than_gguf(tmp_path, smollm, smollm_path):
  """The converted default model loads identically (timings are reported, not asserted)."""
  import time
  path = save_orbax(smollm, str(tmp_path / "smol"))
  start = time.perf_counter()
  back = load_checkpoint(path)
  orbax_s = time.perf_counter() - start
  assert back.config == smollm.config
  assert_params_equal(back.params, smollm.params)
  _same_tokenizer(back.tokenizer, smollm.tokenizer)
  print(f"orbax load {orbax_s:.2f}s")
