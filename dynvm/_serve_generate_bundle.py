"""A generator on disk, for `dynvm serve`: a directory with its programs, what the
token loop needs to know about them, and the model's tokenizer when it ships one.

    generator = dynvm.compile_generator(hf_causal_lm, max_batch=16, max_length=512)
    dynvm.save_generator(generator, "gen/", tokenizer=hf_tokenizer)   # then: dynvm serve gen/

compile_generator exports the packed step by default, the form the serving scheduler
runs as one call a step (Note [The packed step by default] in dynvm._generation_export);
a generator saved in the rows form (packed=False, or before that default) is served
too, and `dynvm serve` says it would do better exported again.

    gen/generator.json   format, layers, max_batch, max_length, eos_token_ids, pad_token_id,
                         chunk, packed (the step's packed form; absent: rows)
    gen/step.dvm         the step over the KV cache as state, prompt chunks and decode
                         (Note [One step program for prompt and decode] in
                         dynvm._generation_kv): one copy of the weights
    gen/prefill.dvm      optional (a generator exported with `pure`): the prefill program
    gen/decode.dvm       optional, with prefill.dvm: the decode program over plain caches
    gen/tokenizer.json   optional: a Hugging Face `tokenizers` file (text in and out)

Each program is a .dvm file of its own, so each holds the weights: a generator saved
with its step alone (compile_generator's default) has them once on disk and in memory.
Format 1 (prefill, decode and a T = 1 decode_kv) is refused: export it again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dynvm._generation_export import GeneratorPrograms
from dynvm.vm import dvm_file
from dynvm.vm.errors import ConfigError

FORMAT = 2
MANIFEST = "generator.json"
TOKENIZER = "tokenizer.json"
_FIELDS = ("layers", "max_batch", "max_length", "eos_token_ids", "pad_token_id")


@dataclass(frozen=True)
class GeneratorBundle:
    """A generator loaded from its directory: the programs and, if shipped, the
    tokenizer (a `tokenizers.Tokenizer`)."""

    programs: GeneratorPrograms
    """The programs and the loop's facts (eos, pad, limits)."""
    tokenizer: object | None
    """The model's `tokenizers.Tokenizer`, or None: token ids only."""
    name: str
    """The directory's name: the default model name when served."""


def is_generator_bundle(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory written by `save_generator`."""
    return (Path(path) / MANIFEST).is_file()


def saved_packed(path: str | os.PathLike) -> bool:
    """Whether the generator saved at `path` has the packed step (generator.json's
    "packed"; absent, as in bundles saved before it was the default: the rows form)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("packed") is True


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
    for name in ("step", "prefill", "decode"):
        if getattr(programs, name) is not None:
            dvm_file.save(getattr(programs, name), directory / f"{name}.dvm")
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "save"):
            raise ConfigError(f"save_generator: tokenizer must be a tokenizers.Tokenizer or "
                              f"a fast Hugging Face tokenizer, got {type(tokenizer).__name__}")
        backend.save(str(directory / TOKENIZER))
    manifest = {"format": FORMAT, **{f: getattr(programs, f) for f in _FIELDS}}
    manifest["eos_token_ids"] = list(programs.eos_token_ids)
    manifest["chunk"] = programs.chunk
    manifest["packed"] = programs.packed
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
    loaded = {name: dvm_file.load(directory / f"{name}.dvm") if (
        directory / f"{name}.dvm").is_file() else None for name in ("step", "prefill", "decode")}
    try:
        chunk = int(manifest.get("chunk", 0))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{directory / MANIFEST}: chunk: {exc}") from None
    programs = GeneratorPrograms(eos_token_ids=eos, chunk=chunk, **loaded, **facts,
                                 packed=manifest.get("packed") is True)
    tokenizer = None
    if (directory / TOKENIZER).is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(directory / TOKENIZER))
    return GeneratorBundle(programs, tokenizer, directory.resolve().name)
