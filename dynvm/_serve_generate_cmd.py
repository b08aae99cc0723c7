"""`dynvm serve GENERATOR_DIR`: what `dynvm serve` does differently for a generator (a
directory written by `save_generator`): its flags, its deployment and its hint.

    dynvm serve gen/ --name tiny --max-tokens 256
    curl -N localhost:8000/v1/completions -d '{"prompt": [1, 2, 3], "stream": true}'

The generator is one Serve application at route prefix `/` (dynvm.cluster.
serving._generate_replica): OpenAI's /v1/completions and the v2 generate extension, with
continuous batching (dynvm.cluster.serving._generate_scheduler). --max-batch-size caps the rows
decoded at once and --max-queued the waiting room, as they cap inference batches.
"""

from __future__ import annotations

from dynvm._run_cmd import CliError


def add_generate_arguments(parser) -> None:
    """The generator's flags (`dynvm serve`'s "generation" group): one per field of
    SchedulerConfig (Note [Flags from config fields]); its rows and waiting room are
    --max-batch-size and --max-queued, the inference flags of the same settings."""
    from dynvm.cluster.serving._config_flags import add_config_flags
    from dynvm.cluster.serving._generate_scheduler import SchedulerConfig

    add_config_flags(parser, SchedulerConfig(), group=(
        "generation", "for a generator directory (dynvm._serve_generate_bundle."
        "save_generator): OpenAI /v1/completions and /v2/models/<name>/generate[_stream], "
        "continuous batching; 0 in a size: the generator's own"))


def scheduler_from_args(args):
    """SchedulerConfig from the flags that were given (CliError for a bad one)."""
    from dynvm.cluster.serving._config_flags import FlagError, config_from_flags
    from dynvm.cluster.serving._generate_scheduler import SchedulerConfig

    try:
        return config_from_flags(args, SchedulerConfig())
    except FlagError as exc:
        raise CliError(f"bad generation flag: {exc}", 2) from None


def is_generator(path: str) -> bool:
    """Whether `dynvm serve` was given a generator directory."""
    from dynvm._serve_generate_bundle import is_generator_bundle

    return is_generator_bundle(path)


def deploy(options, fleet) -> dict:
    """Deploy the generator of `options` (ServeOptions) with its replicas linked to the
    fleet (`FleetOptions`: the compile service and the kernel store); Serve must be
    started."""
    from dynvm.cluster.serving._generate_replica import serve_generator

    return serve_generator(options.name, options.model_path,
                           options.serving.replace(fleet=fleet), options.generate)


def hint(options, base: str, replicas: list[str]) -> str:
    """The lines `dynvm serve` prints for a generator at `base` (http://host:port, Serve's
    proxy) whose replicas also answer at `replicas` (direct ingress)."""
    from dynvm._serve_generate_bundle import saved_packed

    model = f"{base}/v2/models/{options.name}"
    rows = "" if saved_packed(options.model_path) else (
        f"note      {options.model_path} holds the step's rows form: a step that writes a "
        f"prompt chunk is two calls and inter-token latency swings with it; export it "
        f"again with dynvm.compile_generator (packed by default) and save_generator\n")
    direct = (f"direct    {options.name}'s replicas at {', '.join(replicas)} (every route; "
              f"each replica its port); everything also answers through Serve's proxy, "
              f"slower:\n") if replicas else ""
    return f"""\
{rows}{direct}serving   generator {options.name} at {base}/v1/completions and {model}/generate
  curl -N {base}/v1/completions -d '{{"model": "{options.name}", "prompt": [1, 2, 3], \
"max_tokens": 16, "stream": true}}'
  curl -N {model}/generate_stream -d '{{"input_ids": [1, 2, 3], "parameters": \
{{"max_tokens": 16}}}}'
  python: openai.OpenAI(base_url="{base}/v1", api_key="-").completions.create(...)
  curl {model}/stats  /  curl {base}/metrics     # TTFT, ITL, tokens/s, occupancy
Ctrl-C (or SIGTERM) drains and stops everything; a second one stops at once."""

