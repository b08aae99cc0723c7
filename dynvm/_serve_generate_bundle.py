"""A generator on disk, for `dynvm serve`: a directory with its two programs, what the
token loop needs to know about them, and the model's tokenizer when it ships one.

    generator = dynvm.compile_generator(hf_causal_lm, max_batch=16, max_length=512)
    dynvm.save_generator(generator, "gen/", tokenizer=hf_tokenizer)   # then: dynvm serve gen/

    gen/generator.json   format, layers, max_batch, max_length, eos_token_ids, pad_token_id
    gen/prefill.dvm      the prefill program (dynvm.save)
    gen/decode.dvm       the decode program
    gen/decode_kv.dvm    optional: the decode step over the KV cache as state
    gen/tokenizer.json   optional: a Hugging Face `tokenizers` file (text in and out)

Each program is a .dvm file of its own, so each holds the weights: on disk and once
loaded the weights are there twice (in memory, `compile_generator`'s two programs share
one copy). One program with two entry points is issue 32's; this format then changes
its `format` number.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dynvm._generation_export import GeneratorPrograms
from dynvm.vm import dvm_file
from dynvm.vm.errors import ConfigError

FORMAT = 1
MANIFEST = "generator.json"
TOKENIZER = "tokenizer.json"
_FIELDS = ("layers", "max_batch", "max_length", "eos_token_ids", "pad_token_id")


@dataclass(frozen=True)
class GeneratorBundle:
    """A generator loaded from its directory: the programs and, if shipped, the
    tokenizer (a `tokenizers.Tokenizer`)."""

    programs: GeneratorPrograms
    """The prefill and decode programs and the loop's facts (eos, pad, limits)."""
    tokenizer: object | None
    """The model's `tokenizers.Tokenizer`, or None: token ids only."""
    name: str
    """The directory's name: the default model name when served."""


def is_generator_bundle(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory written by `save_generator`."""
    return (Path(path) / MANIFEST).is_file()


def save_generator(generator, path: str | os.PathLike, tokenizer=None) -> Path:
    """Write a `Generator` (or its `GeneratorPrograms`) to the directory `path` (made if
    missing), with `tokenizer` (a `tokenizers.Tokenizer` or a Hugging Face fast tokenizer)
    when given. Returns the directory."""
    programs = getattr(generator, "programs", generator)
    if not isinstance(programs, GeneratorPrograms):
        raise ConfigError(f"save_generator: expected a Generator or GeneratorPrograms, got "
                          f"{type(generator).__name__}")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    dvm_file.save(programs.prefill, directory / "prefill.dvm")
    dvm_file.save(programs.decode, directory / "decode.dvm")
    if getattr(programs, "decode_kv", None) is not None:
        dvm_file.save(programs.decode_kv, directory / "decode_kv.dvm")
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "save"):
            raise ConfigError(f"save_generator: tokenizer must be a tokenizers.Tokenizer or "
                              f"a fast Hugging Face tokenizer, got {type(tokenizer).__name__}")
        backend.save(str(directory / TOKENIZER))
    manifest = {"format": FORMAT, **{f: getattr(programs, f) for f in _FIELDS}}
    manifest["eos_token_ids"] = list(programs.eos_token_ids)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return directory


def load_generator(path: str | os.PathLike) -> GeneratorBundle:
    """Read a directory written by `save_generator` (ConfigError when it is not one)."""
    directory = Path(path)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{directory}: not a generator directory ({MANIFEST}: {exc})") \
            from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ConfigError(f"{directory / MANIFEST}: expected format {FORMAT}, got "
                          f"{manifest.get('format') if isinstance(manifest, dict) else '?'}")
    missing = [f for f in _FIELDS if f not in manifest]
    if missing:
        raise ConfigError(f"{directory / MANIFEST}: missing {missing[0]!r}")
    try:
        facts = {f: int(manifest[f]) for f in _FIELDS if f != "eos_token_ids"}
        eos = tuple(int(t) for t in manifest["eos_token_ids"])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{directory / MANIFEST}: {exc}") from None
    state = directory / "decode_kv.dvm"
    extra = {"decode_kv": dvm_file.load(state)} if state.is_file() else {}
    programs = GeneratorPrograms(
        prefill=dvm_file.load(directory / "prefill.dvm"),
        decode=dvm_file.load(directory / "decode.dvm"), eos_token_ids=eos, **facts, **extra)
    tokenizer = None
    if (directory / TOKENIZER).is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER))
    return GeneratorBundle(programs, tokenizer, directory.resolve().name)
