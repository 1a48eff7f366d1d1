"""Test helpers: tiny model folders (model + an offline character-level tokenizer) and a plugin object."""

from __future__ import annotations

import string
from pathlib import Path

import lcx

from tests.conftest import tiny_model

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list(string.printable[:95])  # digits, letters, punctuation, space


def char_tokenizer():
    """A character-level fast tokenizer built offline (no hub): 4 specials + 95 printable ASCII chars."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def make_tiny_model_dir(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``family`` model and the character tokenizer into ``path``."""
    overrides.setdefault("vocab_size", 128)
    model = tiny_model(family, seed=seed, **overrides)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    char_tokenizer().save_pretrained(str(path))
    return path



class MethodsPlugin:
    """A plugin object (not a module) registering the given method classes."""

    def __init__(self, *classes):
        self.classes = classes

    @lcx.hookimpl
    def lcx_register_methods(self, register):
        for cls in self.classes:
            register(cls)


def make_word_documents(folder: Path, words: tuple[str, ...] = ("alpha", "beta", "gamma")) -> Path:
    """One short document per word (``{word} {i} `` repeated), as files 0.txt, 1.txt, ... in ``folder``."""
    folder.mkdir(parents=True)
    for i, word in enumerate(words):
        (folder / f"{i}.txt").write_text(f"{word} {i} " * 60)
    return folder
