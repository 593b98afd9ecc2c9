"""The character tokenizer: ids, round trips, specials, unknown characters, tokenizer.json, and
the tokenizer interface it shares with `tokenizers` / `transformers` tokenizers."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from jetrl.data import ALPHABET, CharTokenizer, Tokenizer, char_tokenizer, get_task, stop_token_ids

TOK = char_tokenizer()
texts = st.text(alphabet=ALPHABET, max_size=300)


def bare(text):
  return TOK.encode(text, add_special_tokens=False)


def test_specials_and_size():
  assert (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id) == (0, 1, 2)
  assert TOK.eos_token_ids == (2,) and stop_token_ids(TOK) == (2,)
  assert TOK.vocab_size == len(TOK) == len(ALPHABET) + 3 <= 128
  assert isinstance(TOK, Tokenizer)
  # Written out by hand: the documented id layout; bos first when special tokens are added.
  assert bare("\n 09+az") == [3, 4, 5, 14, 15, 27, 52]
  assert TOK.encode("\n 09+az") == [1, 3, 4, 5, 14, 15, 27, 52]
  assert len(set(bare(ALPHABET))) == len(ALPHABET)
  assert sorted(bare(ALPHABET)) == list(range(3, TOK.vocab_size))


@given(texts)
def test_round_trip(text):
  ids = bare(text)
  assert len(ids) == len(text)
  assert all(3 <= i < TOK.vocab_size for i in ids)
  assert TOK.decode(ids) == text
  assert TOK.decode(TOK.encode(text) + [TOK.eos_token_id]) == text


@given(texts, texts)
def test_decode_stops_at_eos_and_drops_pad_bos(a, b):
  ids = TOK.encode(a) + [TOK.pad_token_id] + [TOK.eos_token_id] + bare(b)
  assert TOK.decode(ids) == a
  assert TOK.decode(bare(a) + [TOK.pad_token_id] * 5) == a


@pytest.mark.parametrize("text", ["A", "1|2", "é", "\t", "٣", "x\u00a0y", "<|eos|>"])
def test_unknown_character_is_an_error(text):
  with pytest.raises(ValueError, match="not in the tokenizer's alphabet"):
    TOK.encode(text)


def test_bad_ids_and_inputs():
  with pytest.raises(ValueError):
    TOK.decode([TOK.vocab_size])
  with pytest.raises(ValueError):
    TOK.encode(b"12")
  with pytest.raises(ValueError):
    CharTokenizer("aa")
  with pytest.raises(ValueError):
    CharTokenizer("ab|")
  with pytest.raises(ValueError):
    CharTokenizer("".join(chr(0x100 + i) for i in range(126)))


def test_save_load(tmp_path):
  path = TOK.save(tmp_path / "tok")
  assert path.endswith("tokenizer.json")
  loaded = CharTokenizer.load(tmp_path / "tok")
  assert loaded == TOK and loaded.vocab_size == TOK.vocab_size
  assert loaded.encode("12+3=15\nanswer: 15") == TOK.encode("12+3=15\nanswer: 15")
  assert CharTokenizer.load(path) == TOK
  custom = CharTokenizer("01\n")
  custom.save(tmp_path / "custom")
  assert CharTokenizer.load(tmp_path / "custom").alphabet == "01\n"
  with pytest.raises(ValueError):
    CharTokenizer.load(tmp_path / "missing")
  bad = json.loads(open(path).read())
  bad["model"]["vocab"]["ab"] = bad["model"]["vocab"].pop("a")
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "tokenizer.json").write_text(json.dumps(bad))
  with pytest.raises(ValueError):
    CharTokenizer.load(tmp_path / "bad")


@settings(max_examples=50)
@given(texts)
def test_tokenizers_library_agrees(text):
  lib = TOK.to_tokenizers()
  assert lib.encode(text, add_special_tokens=False).ids == bare(text)
  assert lib.encode(text).ids == TOK.encode(text)  # bos first, the same way
  assert lib.decode(bare(text)) == text


def test_tokenizers_library_reads_the_file(tmp_path):
  from tokenizers import Tokenizer

  lib = Tokenizer.from_file(TOK.save(tmp_path))
  text = "sort 52 7\n52>7\n= 7 52\nanswer: 7 52"
  assert lib.encode(text).ids == TOK.encode(text)
  assert lib.get_vocab_size() == TOK.vocab_size
  assert lib.token_to_id("<|eos|>") == TOK.eos_token_id
  with pytest.raises(Exception):
    lib.encode("A")  # unknown characters are refused there too


def test_transformers_reads_the_file(tmp_path):
  transformers = pytest.importorskip("transformers")
  hf = transformers.PreTrainedTokenizerFast(
    tokenizer_file=TOK.save(tmp_path), pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
  )
  text = "123*45\n123*5=615 615\nanswer: 5535"
  assert hf(text, add_special_tokens=False)["input_ids"] == bare(text)
  # The same interface and ids: what the runner uses of a tokenizer.
  assert isinstance(hf, Tokenizer) and stop_token_ids(hf) == (2,) and len(hf) == len(TOK)
  assert hf.encode(text) == TOK.encode(text)
  assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
  assert hf.decode(bare(text)) == TOK.decode(bare(text))


@settings(max_examples=60, deadline=None)
@given(
  st.sampled_from(["addition", "multiplication", "sorting"]),
  st.integers(0, 10**6),
  st.integers(0, 3),
)
def test_alphabet_covers_every_synthetic_task(name, index, knob):
  task = get_task(name, difficulty=[1, 2, 5, 9][knob], length=[2, 3, 7, 12][knob])
  for split in ("train", "test"):
    p = task.problem(split, index)
    assert TOK.can_encode(p.prompt + p.solution + p.answer)
