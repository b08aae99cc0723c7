"""`dynvm bench generate`: greedy generation, prompt 32 + 128 new tokens, on a Llama-style
and a GPT-2-width decoder (random weights, nothing downloaded; `--models llama-2048` a
Llama-style one at 2048 width), in an eager step loop,
Hugging Face `generate`, the dynvm interpreter and JIT (dynvm.compile_generator), and
CTranslate2 when the bench extra brought it; writes results.json and report.md.

Note [Generation timing]
~~~~~~~~~~~~~~~~~~~~~~~~
Each system generates the same prompts one after another (not interleaved call by call
as the suite: a generation is one long call whose steps depend on each other). Decode
tokens/s is B x decode steps / the decode steps' wall time (prefill apart, its own
column); p50/p99 are per decode step. The JIT runs its default JitConfig (background
compiles, a server's policy) and is measured on its first generation (what a fresh
server gives its first request, compiles running meanwhile) and its second and third
(the first's compiles landed or not); `specialized` is the share of decode steps in
which every region ran specialized code (Generator.stats). `dynvm-jit-wait` is the JIT
without the generator's compile-ahead (Note [Compiling the next length bucket]), first
generation only. HF `generate` is timed whole
(its decode rate: B x new tokens / (total - our eager prefill time)). CTranslate2 gets a
model converted from the same weights by its own converter (a word-level tokenizer
with one token per id is written beside it, since the converter reads the vocabulary
from a tokenizer) and generates with `sampling_topk=1`, min = max length, so it does
the same steps. Tokens are compared with the eager loop's, and the report says where
they differ. The dynvm generators run the one step program over the KV cache as state
(the default: the prompt written in chunks of up to 128 tokens by the same program that
decodes, Note [One step program for prompt and decode] in dynvm._generation_kv, so
"prefill" is those calls); `dynvm-jit-pure` is the JIT on the pure prefill and decode
programs (the cache as tensors).
One torch thread count for everything (--threads, default 2), and the
1-minute load average beside the table: the host is shared.

Note [Generations interleaved with CTranslate2's]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One after another, a ratio to CTranslate2 carries whatever the host did in between:
CTranslate2's own B=1 rate moved 69-81 tok/s between runs on 2026-12-05. System
`dynvm-jit-vs-ct2` (with `ctranslate2`) alternates whole generations instead, on the
same prompts, after the JIT's kernels have landed (two generations, then settled):
each round is a JIT generation and two CTranslate2 generations, the order turned every
round, INTERLEAVED_ROUNDS rounds. Its rows give each system's median decode rate over
the rounds, the JIT's divided by CTranslate2's, and an A/A beside it: CTranslate2's
second generation of each round over its first, the median's distance from 1 being the
margin a ratio has to clear.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

PROMPT, NEW = 32, 128
MODELS = ("llama", "gpt2")
WIDE = "llama-2048"
"""A Llama-style decoder at 2048 width (`--models llama-2048`, not in the default run:
1.2 GB of weights): the released widths' upper end, where decoding at B=1 streams
the weights."""
SYSTEMS = ("eager", "hf", "dynvm-interp", "dynvm-jit-wait", "dynvm-jit", "dynvm-jit-pure",
           "ctranslate2")
INTERLEAVED = "dynvm-jit-vs-ct2"
"""Not in the default set: the JIT's generations alternated with CTranslate2's (Note
[Generations interleaved with CTranslate2's])."""
INTERLEAVED_ROUNDS = 6


@dataclass
class Row:
    """One system's generation on one model and batch size."""

    model: str
    batch: int
    system: str
    prefill_ms: float
    decode_tokens_per_s: float
    decode_tokens_per_cpu_s: float
    """B x decode steps / this process's CPU seconds over them (time.process_time): what
    other processes on a shared host cannot inflate; background compiles included."""
    step_p50_ms: float
    step_p99_ms: float
    specialized: str = ""
    same_tokens: str = ""
    note: str = ""


@dataclass
class Results:
    """A run's rows and its conditions."""

    rows: list[Row] = field(default_factory=list)
    export_seconds: dict[str, float] = field(default_factory=dict)
    resident_mb: dict[str, dict[str, float]] = field(default_factory=dict)
    threads: int = 2
    load_before: str = ""
    load_after: str = ""
    versions: dict[str, str] = field(default_factory=dict)


def build_model(kind: str) -> torch.nn.Module:
    """Random-weight decoders at the issue's widths (4 layers each)."""
    from tests.zoo._schemas import declare_torchvision_schemas

    declare_torchvision_schemas()
    import transformers as hf

    torch.manual_seed(0)
    if kind == "llama":
        model = hf.LlamaForCausalLM(hf.LlamaConfig(
            hidden_size=768, num_attention_heads=12, num_key_value_heads=4,
            num_hidden_layers=4, intermediate_size=2048, vocab_size=32000,
            max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    elif kind == WIDE:
        model = hf.LlamaForCausalLM(hf.LlamaConfig(
            hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
            num_hidden_layers=4, intermediate_size=5632, vocab_size=32000,
            max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    elif kind == "gpt2":
        model = hf.GPT2LMHeadModel(hf.GPT2Config(
            n_embd=768, n_head=12, n_layer=4, vocab_size=32000, n_positions=2048,
            pad_token_id=0, bos_token_id=1, eos_token_id=2))
    else:
        raise ValueError(f"model {kind!r}: expected one of {(*MODELS, WIDE)}")
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = None  # every run makes all NEW steps
    return model.eval()


def _anon_mb() -> float:
    """Anonymous resident MiB (not the libraries' code pages), read after gc and
    malloc_trim(0) so that freed memory glibc keeps is not counted (Note [A generator's
    resident memory] in dynvm._generate_memory)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        _, resident, shared, *_ = (int(v) for v in statm.read().split())
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _tensor_mb() -> float:
    """MiB of the distinct storages that live CPU tensors view, and of live oneDNN-packed
    (opaque) tensors: what the process holds in tensors, each storage once."""
    from dynvm._generate_memory import live_tensors

    storages, opaque = live_tensors()
    return (sum(storages.values()) + sum(opaque.values())) / 2**20


def _row(model, batch, system, prefill_s, steps, cpu_s, **extra) -> Row:
    steps_ms = sorted(s * 1e3 for s in steps)
    p99 = steps_ms[min(len(steps_ms) - 1, int(round(0.99 * (len(steps_ms) - 1))))]
    return Row(model, batch, system, prefill_s * 1e3, batch * len(steps) / sum(steps),
               batch * len(steps) / cpu_s, statistics.median(steps_ms), p99, **extra)


def _eager_loop(model, ids, mask, new: int = NEW):
    """The step functions compile_generator exports, run eagerly: the same loop."""
    from dynvm._generation_export import _Decode, _Prefill

    prefill, decode = _Prefill(model), _Decode(model)
    with torch.inference_mode():
        start = time.perf_counter()
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        logits, keys, values = prefill(ids, mask, positions)
        token = logits.argmax(-1)
        prefill_s = time.perf_counter() - start
        tokens, steps = [token], []
        cpu = time.process_time()
        for _ in range(new - 1):
            start = time.perf_counter()
            position = mask.sum(-1, keepdim=True)
            logits, keys, values = decode(token[:, None], mask, position, keys, values)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            token = logits.argmax(-1)
            steps.append(time.perf_counter() - start)
            tokens.append(token)
        cpu = time.process_time() - cpu
    return torch.stack(tokens, 1), prefill_s, steps, cpu


def _dynvm(generator, ids, mask):
    before = generator.stats()
    start = time.perf_counter()
    tokens, stamps = [], []
    for token in generator.stream(ids, mask, max_new_tokens=NEW, stop_tokens=()):
        tokens.append(token)
        stamps.append(time.perf_counter())
        if len(stamps) == 1:
            cpu = time.process_time()
    cpu = time.process_time() - cpu
    after = generator.stats()
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    share = (after.specialized_steps - before.specialized_steps,
             after.decode_steps - before.decode_steps)
    return torch.stack(tokens, 1), stamps[0] - start, steps, share, cpu


def convert_to_ct2(model, folder: Path) -> Path:
    """`model` converted by CTranslate2's own converter into folder/ct2 (through a Hugging
    Face checkpoint in folder/hf, with a word-level tokenizer whose token t<i> is id i)."""
    import ctranslate2
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        vocab, unk_token="t0")), unk_token="t0", pad_token="t0", bos_token="t1",
        eos_token="t2")
    model.save_pretrained(folder / "hf")
    tokenizer.save_pretrained(folder / "hf")
    ctranslate2.converters.TransformersConverter(str(folder / "hf")).convert(
        str(folder / "ct2"), force=True)
    return folder / "ct2"


def _ctranslate2(model, kind: str, threads: int):
    """A CTranslate2 generator converted from the same weights, or a reason why not."""
    try:
        import ctranslate2
        import tokenizers  # noqa: F401 (convert_to_ct2's; a missing one is reported here)
        import transformers  # noqa: F401
    except ImportError as exc:
        return None, f"not installed ({exc.name}): pip install -e .[bench]"
    folder = Path(tempfile.mkdtemp(prefix=f"dynvm-ct2-{kind}-"))
    try:
        return ctranslate2.Generator(str(convert_to_ct2(model, folder)), device="cpu",
                                     intra_threads=threads), ""
    except Exception as exc:  # a converter that refuses this transformers: reported
        return None, f"conversion failed: {type(exc).__name__}: {str(exc)[:160]}"


def _ct2_run(ct2, ids):
    prompts = [[f"t{int(t)}" for t in row] for row in ids]
    start, cpu = time.perf_counter(), time.process_time()
    ct2.generate_batch(prompts, max_length=1, sampling_topk=1, include_prompt_in_result=False)
    prefill_s, prefill_cpu = time.perf_counter() - start, time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    out = ct2.generate_batch(prompts, max_length=NEW, min_length=NEW, sampling_topk=1,
                             include_prompt_in_result=False)
    total, total_cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = torch.tensor([r.sequences_ids[0][:NEW] for r in out])
    return tokens, prefill_s, total, max(total_cpu - prefill_cpu, 1e-9)


def run_model(kind: str, batches, systems, threads: int, results: Results,
              jit_config=True) -> None:
    """Every system on one model, each batch size."""
    import dynvm

    model = build_model(kind)
    weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    # Note [A generator's resident memory]: each reading after gc and malloc_trim(0),
    # anonymous pages only; tensors counted as distinct storages beside it.
    after_model, tensors_model = _anon_mb(), _tensor_mb()
    start = time.perf_counter()
    programs = dynvm.compile_generator(model, max_batch=max(16, *batches),
                                       max_length=PROMPT + NEW + 1, jit=False,
                                       pure="dynvm-jit-pure" in systems).programs
    results.export_seconds[kind] = time.perf_counter() - start
    memory = results.resident_mb[kind] = {
        "weights": weights_mb,
        # The process's first export pays torch.export's own first use too.
        "programs": _anon_mb() - after_model,
        "of_which_new_tensors": _tensor_mb() - tensors_model}
    with dynvm.Generator(programs, jit=jit_config) as jit:
        # One generation at B=1 before anything else is built: what a generator adds.
        ids = torch.randint(3, model.config.vocab_size, (1, PROMPT))
        jit.generate(ids, max_new_tokens=NEW, stop_tokens=())
        _settle(jit)
        memory["jit_generator_b1"] = _anon_mb() - after_model
        memory["of_which_new_tensors_held"] = _tensor_mb() - tensors_model
        held = jit.memory()   # what the generator states it holds, by cause
        memory.update({f"stated_{k}": getattr(held, k) / 2**20 for k in (
            "weights", "cache", "packed_weights", "arenas", "total")})
    # A second generator over the same programs, the process's first uses paid: what
    # each generator adds (its KV pages as far as one B=1 generation touched them).
    before = _anon_mb()
    with dynvm.Generator(programs, jit=jit_config) as again:
        again.generate(ids, max_new_tokens=NEW, stop_tokens=())
        _settle(again)
        memory["second_generator_b1"] = _anon_mb() - before
        held = again.memory()
        memory["second_stated_beyond_weights"] = (held.total - held.weights) / 2**20
    interp = dynvm.Generator(programs, jit=False) if "dynvm-interp" in systems else None
    ct2, ct2_note = (_ctranslate2(model, kind, threads) if "ctranslate2" in systems
                     else (None, ""))
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(3, model.config.vocab_size, (batch, PROMPT), generator=gen)
        mask = torch.ones_like(ids)
        _eager_loop(model, ids, mask, new=3)  # first-use costs of this batch size
        reference, prefill_s, steps, cpu_s = _eager_loop(model, ids, mask)
        if "eager" in systems:
            results.rows.append(_row(kind, batch, "eager", prefill_s, steps, cpu_s))

        def same(tokens, reference=reference):
            return "yes" if torch.equal(tokens, reference) else "NO"

        if "hf" in systems:
            with torch.inference_mode():
                model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
                start, cpu = time.perf_counter(), time.process_time()
                out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                     min_new_tokens=NEW, do_sample=False, pad_token_id=0)
                total, cpu = time.perf_counter() - start, time.process_time() - cpu
            decode_s = max(total - prefill_s, 1e-9)
            results.rows.append(Row(kind, batch, "hf", float("nan"),
                                    batch * (NEW - 1) / decode_s, batch * NEW / cpu,
                                    float("nan"), float("nan"),
                                    same_tokens=same(out[:, PROMPT:]),
                                    note="timed whole; CPU rate with its prefill"))
        if interp is not None:
            interp.generate(ids, mask, max_new_tokens=3, stop_tokens=())
            tokens, prefill_s, steps, _, cpu_s = _dynvm(interp, ids, mask)
            results.rows.append(_row(kind, batch, "dynvm-interp", prefill_s, steps, cpu_s,
                                     same_tokens=same(tokens)))
        if "dynvm-jit-wait" in systems:
            # The JIT's own rule alone (no compile-ahead): its first generation.
            with dynvm.Generator(programs, jit=jit_config, compile_ahead=False) as jit:
                tokens, prefill_s, steps, (hit, total), cpu_s = _dynvm(jit, ids, mask)
                results.rows.append(_row(kind, batch, "dynvm-jit-wait gen 1", prefill_s,
                                         steps, cpu_s, specialized=f"{hit}/{total}",
                                         same_tokens=same(tokens)))
        if "dynvm-jit" in systems:
            with dynvm.Generator(programs, jit=jit_config) as jit:
                for n in (1, 2, 3):
                    tokens, prefill_s, steps, (hit, total), cpu_s = _dynvm(jit, ids, mask)
                    results.rows.append(_row(
                        kind, batch, f"dynvm-jit gen {n}", prefill_s, steps, cpu_s,
                        specialized=f"{hit}/{total}", same_tokens=same(tokens)))
                # What the generator states it holds after this batch size's kernels
                # (packed weight copies would show here, beside the one copy).
                _settle(jit)
                held = jit.memory()
                memory[f"jit_b{batch}_stated_beyond_weights"] = (
                    held.total - held.weights) / 2**20
                memory[f"jit_b{batch}_stated_packed_weights"] = held.packed_weights / 2**20
        if "dynvm-jit-pure" in systems:
            # The pure decode step (the cache as tensors grown by CAT), as before the KV
            # cache was state (Note [KV cache as state] in dynvm.vm.ops_kv).
            with dynvm.Generator(programs, jit=jit_config, kv_state=False) as jit:
                for n in (1, 2):
                    tokens, prefill_s, steps, (hit, total), cpu_s = _dynvm(jit, ids, mask)
                    results.rows.append(_row(
                        kind, batch, f"dynvm-jit-pure gen {n}", prefill_s, steps, cpu_s,
                        specialized=f"{hit}/{total}", same_tokens=same(tokens)))
        if INTERLEAVED in systems and ct2 is not None:
            results.rows.extend(_interleaved(kind, batch, programs, jit_config, ct2, ids,
                                             mask, same))
        if ct2 is not None:
            _ct2_run(ct2, ids)  # its first call: allocations, not a generation's steady time
            tokens, prefill_s, total, cpu_s = _ct2_run(ct2, ids)
            decode_s = max(total - prefill_s, 1e-9)
            results.rows.append(Row(kind, batch, "ctranslate2", prefill_s * 1e3,
                                    batch * (NEW - 1) / decode_s, batch * (NEW - 1) / cpu_s,
                                    float("nan"),
                                    float("nan"), same_tokens=same(tokens),
                                    note="timed whole (prefill: a 1-token call)"))
        elif ct2_note:
            nan = float("nan")
            results.rows.append(Row(kind, batch, "ctranslate2", nan, nan, nan, nan, nan,
                                    note=ct2_note))


def long_context(kind: str, length: int, steps: int, results: Results, jit_config=True):
    """Decode steps at a cache of `length` (B=1, random past): eager against the dynvm
    interpreter and JIT (the JIT after one warm-up generation over the same lengths)."""
    import dynvm

    model = build_model(kind)
    programs = dynvm.compile_generator(model, max_batch=4, max_length=length + steps + 2,
                                       jit=False, kv_state=True, pure=True).programs
    ids = torch.randint(3, model.config.vocab_size, (1, length))
    mask = torch.ones_like(ids)
    _eager_loop(model, ids, mask, new=3)
    _, prefill_s, wall, cpu_s = _eager_loop(model, ids, mask, new=steps + 1)
    results.rows.append(_row(kind, 1, f"eager, L={length}", prefill_s, wall, cpu_s))
    # "state": the decode step over the KV cache as state (Note [KV cache as state] in
    # dynvm.vm.ops_kv); the others pass the cache as tensors and grow it by CAT.
    for name, config, state in (("dynvm-interp", False, False),
                                ("dynvm-jit gen 2", jit_config, False),
                                ("dynvm-state interp", False, True),
                                ("dynvm-state jit gen 2", jit_config, True)):
        with dynvm.Generator(programs, jit=config, kv_state=state) as generator:
            if config is not False:
                _dynvm_n(generator, ids, mask, steps + 1)
                _settle(generator)
            before = generator.stats()
            _, prefill_s, wall, _, cpu_s = _dynvm_n(generator, ids, mask, steps + 1)
            hit = generator.stats().specialized_steps - before.specialized_steps
            results.rows.append(_row(kind, 1, f"{name}, L={length}", prefill_s, wall, cpu_s,
                                     specialized=f"{hit}/{steps}"))


def _interleaved(kind, batch, programs, jit_config, ct2, ids, mask, same) -> list[Row]:
    """Note [Generations interleaved with CTranslate2's]: the rows of the JIT and of
    CTranslate2, generations alternated."""
    import dynvm

    def ct2_rate() -> tuple[float, str]:
        tokens, prefill_s, total, _ = _ct2_run(ct2, ids)
        return batch * (NEW - 1) / max(total - prefill_s, 1e-9), same(tokens)

    rates: dict[str, list[float]] = {"jit": [], "ct2": [], "ct2 again": []}
    with dynvm.Generator(programs, jit=jit_config) as jit:
        for _ in range(2):   # the first generation's compiles land; then nothing pending
            _dynvm(jit, ids, mask)
        _settle(jit)
        ct2_rate()
        agree = {"jit": "yes", "ct2": "yes"}
        for round_ in range(INTERLEAVED_ROUNDS):
            for who in (("jit", "ct2") if round_ % 2 == 0 else ("ct2", "jit")):
                if who == "jit":
                    tokens, _, steps, _, _ = _dynvm(jit, ids, mask)
                    rates["jit"].append(batch * len(steps) / sum(steps))
                    if same(tokens) != "yes":
                        agree["jit"] = "NO"
                else:
                    rate, agreed = ct2_rate()
                    again, _ = ct2_rate()
                    rates["ct2"].append(rate)
                    rates["ct2 again"].append(again)
                    if agreed != "yes":
                        agree["ct2"] = "NO"
    jit_rate, ct2_rate_ = (statistics.median(rates[k]) for k in ("jit", "ct2"))
    aa = statistics.median(b / a for a, b in zip(rates["ct2"], rates["ct2 again"]))
    note = (f"interleaved, {INTERLEAVED_ROUNDS} rounds: JIT / CTranslate2 "
            f"{jit_rate / ct2_rate_:.3f}, A/A (CTranslate2 / itself) {aa:.3f}")
    nan = float("nan")
    return [Row(kind, batch, "dynvm-jit interleaved", nan, jit_rate, nan, nan, nan,
                same_tokens=agree["jit"], note=note),
            Row(kind, batch, "ctranslate2 interleaved", nan, ct2_rate_, nan, nan, nan,
                same_tokens=agree["ct2"], note=note)]


def _settle(generator, seconds: float = 10.0) -> None:
    """Wait until no compile is queued or running (at most `seconds`: settled() also
    waits for probation verdicts, which a generator's last kernels may never reach)."""
    deadline = time.monotonic() + seconds
    def busy(runtime) -> bool:
        jit = runtime.jit
        return jit is not None and (len(jit.queue) > 0 or any(
            region.pending for region in list(jit.regions.values())))

    runtimes = [r for r in (generator.step, generator.prefill, generator.decode) if r is not None]
    while time.monotonic() < deadline and any(busy(runtime) for runtime in runtimes):
        time.sleep(0.05)


def _dynvm_n(generator, ids, mask, new):
    start = time.perf_counter()
    stamps = []
    for _ in generator.stream(ids, mask, max_new_tokens=new, stop_tokens=()):
        stamps.append(time.perf_counter())
        if len(stamps) == 1:
            cpu = time.process_time()
    cpu = time.process_time() - cpu
    return None, stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], None, cpu


def report(results: Results) -> str:
    """The markdown table of a run."""
    lines = [f"prompt {PROMPT} + {NEW} greedy tokens, {results.threads} torch threads; "
             f"load average (1 min) before {results.load_before}, after "
             f"{results.load_after}; export (both programs): " + ", ".join(
                 f"{k} {v:.1f} s" for k, v in results.export_seconds.items()), "",
             "| model | B | system | prefill ms | decode tok/s | tok/CPU s | step p50 ms | "
             "step p99 ms | specialized steps | tokens = eager | note |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in results.rows:
        cells = [r.model, str(r.batch), r.system] + [
            "-" if v != v else f"{v:.1f}" for v in (
                r.prefill_ms, r.decode_tokens_per_s, r.decode_tokens_per_cpu_s,
                r.step_p50_ms, r.step_p99_ms)]
        lines.append("| " + " | ".join(cells + [r.specialized, r.same_tokens, r.note]) + " |")
    for kind, mem in results.resident_mb.items():
        lines.append(f"\n{kind}: weights {mem['weights']:.1f} MiB; anonymous resident MiB after "
                     "gc and malloc_trim(0), over the built model (second_generator_b1: over "
                     "the process just before it): " + ", ".join(
                         f"{k} {v:+.1f} MiB" for k, v in mem.items() if k != "weights"))
    return "\n".join(lines)


def run(args) -> int:
    """`dynvm bench generate`; the exit status."""
    threads = args.threads or 2
    torch.set_num_threads(threads)
    models = tuple(args.models.split(",")) if args.models else MODELS
    systems = tuple(args.systems.split(",")) if args.systems else SYSTEMS
    batches = tuple(int(b) for b in (args.batch_sizes or "1,4").split(","))
    results = Results(threads=threads, load_before=Path("/proc/loadavg").read_text().split()[0])
    import transformers

    results.versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    from bench.jit_options import jit_config

    config = jit_config(args.jit_options) if args.jit_options else True
    for kind in models:
        if args.long_context:
            long_context(kind, args.long_context, 16, results, config)
        else:
            run_model(kind, batches, systems, threads, results, config)
    results.load_after = Path("/proc/loadavg").read_text().split()[0]
    out = args.out or Path(__file__).resolve().parent / "results" / time.strftime(
        "generate-%Y%m%d-%H%M%S")
    os.makedirs(out, exist_ok=True)
    text = report(results)
    (out / "results.json").write_text(json.dumps(asdict(results), indent=1, default=str))
    (out / "report.md").write_text(text + "\n")
    print(text)
    print(f"\nwritten to {out}")
    return 0
