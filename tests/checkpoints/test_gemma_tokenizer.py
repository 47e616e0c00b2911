"""Gemma chat templates and end-of-turn ids come from the checkpoint, rendered as transformers does.

Gemma 3's template folds a system message into the first user turn; Gemma 2's
refuses one (`raise_exception`). Our tokenizer renders the checkpoint's own
template, so both behave exactly as `transformers`' `apply_chat_template`.
"""

import jinja2
import pytest
import transformers

from checkpoints import load_checkpoint
from tiny_models import save_tiny_model

CHATS = [
    [{"role": "user", "content": " hi there "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}],
]


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_chat_template_and_eos_as_transformers(family, tmp_path):
  save_tiny_model(family, str(tmp_path))
  ours = load_checkpoint(str(tmp_path))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for chat in CHATS:
    if family == "gemma2" and chat[0]["role"] == "system":
      with pytest.raises(jinja2.exceptions.TemplateError, match="System role not supported"):
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
      with pytest.raises(jinja2.exceptions.TemplateError, match="System role not supported"):
        ours.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
      continue
    want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.tokenizer.apply_chat_template(chat, add_generation_prompt=True) == want
    ids = ours.tokenizer.encode(want)
    assert ids[0] == ours.tokenizer.bos_token_id  # the template's bos_token, one special id
    assert ids.count(ours.tokenizer.token_to_id("<start_of_turn>")) == len(chat) + 1 - (
        chat[0]["role"] == "system")
  end_of_turn = ours.tokenizer.token_to_id("<end_of_turn>")
  assert end_of_turn in ours.tokenizer.eos_token_ids and end_of_turn in ours.config.eos_token_ids
