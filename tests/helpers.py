"""Test helpers: tiny model folders (model + an offline character-level tokenizer), a counter of live tensor storage
and a plugin object."""

from __future__ import annotations

import string
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


class LiveTensors(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those torch ops create while the mode is on
    (storage that existed before, ``held``, counts as none when an op views it)."""

    def __init__(self, held=()):
        super().__init__()
        self.live, self.now, self.peak = {t.untyped_storage().data_ptr(): 0 for t in held}, 0, 0

    def _freed(self, ptr):
        self.now -= self.live.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (s := t.untyped_storage()).data_ptr() not in self.live:
                self.live[s.data_ptr()] = s.nbytes()
                self.now += s.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(s, self._freed, s.data_ptr())
        return out


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
