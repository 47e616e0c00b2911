"""Stop strings, hold-back while streaming, EOS and logprob deltas."""

from checkpoints.tokenizer import Tokenizer
from serving.engine.output_processor import OutputProcessor
from serving.types import SampledToken, SamplingParams, Sequence, TokenLogprob
from tiny_models import byte_tokenizer


def _sampled(token, params):  # one sampled token as the runner reports it
  n = params.logprobs
  lp = None if n is None else TokenLogprob(token, -0.5, [(token, -0.5), (7, -1.5)][:n])
  return SampledToken(token_id=token, logprob=lp)


def run(text, params, eos=frozenset()):
  tok = Tokenizer(byte_tokenizer(), special_tokens={"eos_token": "</s>"})
  proc = OutputProcessor(tok)
  seq = Sequence(request_id="r", prompt_ids=[1], params=params, eos_ids=eos)
  deltas = []
  proc.add(seq, deltas.append)
  stopped = False
  for t in tok.encode(text) + [tok.token_to_id("</s>")]:
    stopped = proc.on_token(seq, _sampled(t, params))
    if stopped or t in eos:
      proc.emit(seq, "stop")
      break
    proc.emit(seq)
  else:
    proc.emit(seq, "length")
  return deltas, stopped


def test_stop_string_truncates_and_is_never_streamed():
  deltas, stopped = run("Hello STOP world", SamplingParams(stop=["STOP"]))
  assert stopped
  assert "".join(d.text for d in deltas) == "Hello "
  assert all("S" not in d.text for d in deltas)
  assert deltas[-1].finish_reason == "stop"


def test_include_stop_string():
  deltas, _ = run("ab##cd", SamplingParams(stop=["##"], include_stop_str_in_output=True))
  assert "".join(d.text for d in deltas) == "ab##"


def test_eos_text_hidden_and_logprobs_reported():
  tok = Tokenizer(byte_tokenizer(), special_tokens={"eos_token": "</s>"})
  eos = frozenset({tok.token_to_id("</s>")})
  deltas, _ = run("héllo", SamplingParams(logprobs=1), eos=eos)
  assert "".join(d.text for d in deltas) == "héllo"
  lps = [lp for d in deltas for lp in d.logprobs]
  assert len(lps) == len(tok.encode("héllo")) + 1
  assert lps[0].top == [(lps[0].token_id, -0.5)]
