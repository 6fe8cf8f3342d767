"""`primebuild export RUN_DIR [--step N]`: a run's trained policy as a Hugging Face folder in the store.

The folder (config.json, safetensors, tokenizer files, chat template) is a store entry keyed by the
checkpoint's bytes (primebuild/builders/export.py), written from the run's DCP checkpoint
(primebuild/runtime/export.py); a manifest starts from it with `model: {from_run: RUN_DIR, step: N}`
or `model: {path: <the printed path>}`.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from primebuild.commands.options import output_option


@click.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--step", type=click.IntRange(min=1), default=None,
              help="The checkpoint step to export (default: the newest one that verifies).")
@click.option("--adapter", is_flag=True,
              help="LoRA runs: write the PEFT adapter folder instead of the base model with the adapters merged.")
@click.option("--max-shard-mb", type=click.IntRange(min=1), default=None,
              help="Cut the safetensors into shards of at most this size (default: 5000, Hugging Face's).")
@click.option("--store", "store_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Store directory (default: $PRIMEBUILD_STORE or ~/.cache/primebuild/store).")
@output_option
def command(run_dir: Path, step: int | None, adapter: bool, max_shard_mb: int | None, store_dir: Path | None,
            output: str) -> None:
    """Export RUN_DIR's policy at checkpoint --step into the store; print the entry's path."""
    from primebuild.builders.export import export_source
    from primebuild.builders.store import Store
    from primebuild.contracts.run_dir import RunDir

    store = Store(store_dir)
    run = RunDir(run_dir.expanduser().absolute())
    if step is None and run.is_run():
        from primebuild.runtime.export import newest_verified_step

        step = newest_verified_step(run.root, warn=lambda line: click.echo(f"warning: {line}", err=True))
    source = export_source(run.root, step)
    from primebuild.runtime.export import export_into_store

    path, existed = export_into_store(source, store, adapter=adapter,
                                      max_shard_bytes=max_shard_mb * 10**6 if max_shard_mb else None)
    if output == "json":
        click.echo(json.dumps({"path": str(path), "run_dir": str(run.root), "step": source.step,
                               "adapter": adapter, "cache_hit": existed}, indent=2, sort_keys=True))
    else:
        click.echo(str(path))
