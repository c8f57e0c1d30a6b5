"""Tokenizers for a person's text: bytes, a byte-level BPE trained here, or a local HF tokenizer.

``data.tokenizer`` (``--tokenizer``) is one of
  * ``bytes`` (the default): each UTF-8 byte is a token, vocabulary 256; needs no package;
  * ``bpe:N``: a byte-level BPE of at most N tokens (257 <= N <= 1,048,576), trained here on
    the corpus with the ``tokenizers`` library (GPT-2's scheme: the 256 bytes are the initial
    alphabet, so every text encodes, and decoding gives the text back exactly). It is trained
    on the first ``BPE_TRAIN_BYTES`` of the corpus, once: the token cache keeps it as
    ``tokenizer.json`` beside the token file, and the run directory gets a copy;
  * a path: a Hugging Face tokenizer, either a ``tokenizer.json`` file or a directory holding
    one (or GPT-2's ``vocab.json`` + ``merges.txt``). Never downloaded.
Special tokens are not added while encoding the corpus (no [CLS] / <s> per chunk).
"""
from __future__ import annotations

import os

import numpy as np

BPE_MIN, BPE_MAX = 257, 1 << 20
BPE_TRAIN_BYTES = 256 << 20    # BPE merges are learned from at most this much text
PIECE_CHARS = 1 << 13          # encode_batch pieces: cut at newlines, about 8 K characters
                               # (measured: 2x faster than 64 K pieces with 2 threads)


def parse_spec(spec: str) -> tuple[str, int | str | None]:
    """('bytes', None) | ('bpe', N) | ('path', path); raise ValueError with the reason."""
    if spec == "bytes":
        return "bytes", None
    if spec.startswith("bpe:"):
        size = spec[4:]
        if not size.isdigit() or not BPE_MIN <= int(size) <= BPE_MAX:
            raise ValueError(f"bpe:N needs a whole N from {BPE_MIN} to {BPE_MAX:,}")
        return "bpe", int(size)
    return "path", os.path.expanduser(spec)


def tokenizer_file(path: str) -> list[str]:
    """The file(s) a tokenizer path stands for: [tokenizer.json] or [vocab.json, merges.txt];
    raise FileNotFoundError when there is none."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        one = os.path.join(path, "tokenizer.json")
        if os.path.isfile(one):
            return [one]
        pair = [os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")]
        if all(os.path.isfile(p) for p in pair):
            return pair
        raise FileNotFoundError(f"{path} holds no tokenizer.json (nor vocab.json + merges.txt)")
    raise FileNotFoundError(f"{path} does not exist")


class ByteTokenizer:
    """Each UTF-8 byte is one token (0-255)."""
    vocab_size = 256

    def encode_chunk(self, raw: bytes, text: str) -> np.ndarray:
        return np.frombuffer(raw, dtype=np.uint8)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer``: the trained BPE or a Hugging Face tokenizer file."""

    def __init__(self, tok):
        self.tok = tok
        # ids can be sparse (added tokens past the base vocabulary): cover the largest one
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    def encode_chunk(self, raw: bytes, text: str) -> np.ndarray:
        pieces = list(_pieces(text))
        if not pieces:
            return np.zeros(0, dtype=np.int64)
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets we never read
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        encs = encode(pieces, add_special_tokens=False)
        return np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encs])

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _pieces(text: str, size: int = PIECE_CHARS):
    """``text`` in pieces of about ``size`` characters, each ending after a newline when there
    is one (so encode_batch can run them in parallel and a line is never cut in two)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def _tokenizers():
    """The tokenizers package, or one line naming the extra."""
    try:
        import tokenizers
    except ImportError:
        from shardwise.config import ConfigError
        raise ConfigError("data.tokenizer", "bpe / a path", "needs the 'tokenizers' package, "
                          "which is not installed", "pip install 'shardwise[hf]'") from None
    return tokenizers


def load(path: str) -> HFTokenizer:
    """A Hugging Face tokenizer from a local file or directory (see :func:`tokenizer_file`)."""
    tokenizers = _tokenizers()
    files = tokenizer_file(path)
    if len(files) == 1:
        return HFTokenizer(tokenizers.Tokenizer.from_file(files[0]))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(*files))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return HFTokenizer(tok)


def train_bpe(texts, vocab_size: int, out_path: str) -> HFTokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens on the strings ``texts`` yields
    (stopping after BPE_TRAIN_BYTES characters); save it to ``out_path`` atomically."""
    tk = _tokenizers()
    decoders, models, pre_tokenizers, trainers = tk.decoders, tk.models, tk.pre_tokenizers, tk.trainers
    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def capped():
        seen = 0
        for text in texts:
            for piece in _pieces(text):
                yield piece
            seen += len(text)
            if seen >= BPE_TRAIN_BYTES:
                return
    tok.train_from_iterator(capped(), trainer=trainer)
    tmp = f"{out_path}.tmp-{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, out_path)
    return HFTokenizer(tok)


def for_spec(spec: str, folder: str) -> ByteTokenizer | HFTokenizer | None:
    """The tokenizer a spec names, as the token cache in ``folder`` keeps it; None for a BPE
    that is not trained yet."""
    kind, arg = parse_spec(spec)
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "path":
        return load(arg)
    trained = os.path.join(folder, "tokenizer.json")
    return load(trained) if os.path.isfile(trained) else None
