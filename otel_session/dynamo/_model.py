"""A tiny, locally built model directory for Dynamo's mocker and frontend.

The mocker never runs a network, but both it and the frontend need a real tokenizer plus a config that
lets them size KV blocks. Downloading one from a model hub is not an option (offline machines, CI), so
we train a small byte-level BPE on deterministic text and write the Hugging Face-style files next to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["DEFAULT_VOCAB_SIZE", "MODEL_FORMAT_VERSION", "default_cache_dir", "ensure_model_dir"]

#: Bump when the generated files change, so caches built by older versions are not reused.
MODEL_FORMAT_VERSION = "1"
DEFAULT_VOCAB_SIZE = 4096

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
_SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]

# minijinja (the frontend's template engine) and jinja2 both accept this. Content may be a plain string
# or a list of OpenAI content parts; only text parts are rendered.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

REQUIRED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "config.json",
)

_WORDS_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at which but have an
    they you were her she there been one all we their has would when if so no will can more about said
    span trace session worker router cache prefix token model request response latency stream agent tool
    user assistant system message turn context window budget error retry timeout queue batch decode
    prefill attention layer block memory transfer metric counter histogram gauge export collector
    python rust function class method return value string integer list dictionary file path network
"""
_WORDS = tuple(_WORDS_TEXT.split())


def default_cache_dir() -> Path:
    """Per-user cache root, so every stack started by this user shares one built model."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "otel-session" / "dynamo-models"


def _pseudo_words(rng: random.Random, count: int) -> list[str]:
    """Pronounceable made-up words: they give BPE many distinct, repeated sub-word pairs to merge."""
    onsets_text = "b br c ch d f g gr h k l m n p pr qu r s sh st t th tr v w z"
    onsets = ["", *onsets_text.split()]
    vowels_text = "a e i o u ai ea io ou y"
    vowels = vowels_text.split()
    codas_text = "n r s t l m nd st ng x"
    codas = ["", "", *codas_text.split()]
    words: set[str] = set()
    while len(words) < count:
        syllables = rng.randint(1, 4)
        words.add(
            "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables))
        )
    return sorted(words)


def _training_corpus(lines: int = 6000, seed: int = 1234) -> Iterator[str]:
    """Deterministic pseudo-English plus code-ish lines: enough variety for a few thousand merges."""
    rng = random.Random(seed)
    vocab = list(_WORDS) + _pseudo_words(rng, 3000)
    punct = [".", ",", "?", "!", ":", ";", ""]
    for i in range(lines):
        n = rng.randint(6, 24)
        words = [rng.choice(_WORDS) if rng.random() < 0.4 else rng.choice(vocab) for _ in range(n)]
        if i % 5 == 0:
            words.append(f"{rng.randint(0, 99999)}")
        if i % 7 == 0:
            words.append(f"{rng.choice(vocab)}_{rng.choice(vocab)}({rng.randint(0, 9)})")
        sentence = " ".join(words)
        yield sentence[0].upper() + sentence[1:] + rng.choice(punct)
    # Every printable ASCII character shows up at least once.
    yield "".join(chr(c) for c in range(32, 127))


def _train_tokenizer(vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    return tok


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _special_id(tok: Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    if token_id is None:  # The trainer always adds special tokens; this guards a tokenizers regression.
        raise RuntimeError(f"special token {token!r} missing from the trained tokenizer")
    return token_id


def _build(target: Path, vocab_size: int) -> None:
    tok = _train_tokenizer(vocab_size)
    tok.save(str(target / "tokenizer.json"))
    real_vocab = tok.get_vocab_size()
    bos_id, eos_id, pad_id = (_special_id(tok, t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN))
    max_len = 131072

    _write_json(
        target / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_len,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        target / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    _write_json(
        target / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False},
    )
    # Llama-shaped so the mocker/frontend can compute KV bytes per token; the numbers are small but sane.
    _write_json(
        target / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": real_vocab,
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "max_position_embeddings": max_len,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
        },
    )


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in REQUIRED_FILES)


def ensure_model_dir(
    cache_dir: str | os.PathLike[str] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Path:
    """Return a ready model directory, building it once per (format version, vocab size).

    The directory is built in a private temp dir and published with one ``rename``, so concurrent
    callers either see nothing or a complete directory; the loser of a race discards its copy.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"tiny-llama-bpe-v{MODEL_FORMAT_VERSION}-{vocab_size}"
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    if final.exists():
        # Damaged by hand (a file deleted): move it aside atomically, then rebuild.
        stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=root))
        with contextlib.suppress(OSError):  # Someone else is repairing it; race fairly below.
            os.rename(final, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".build-{final.name}-", dir=root))
    try:
        _build(tmp, vocab_size)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            # Lost the race (target exists and is non-empty): the winner's copy is equivalent.
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
